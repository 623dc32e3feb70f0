"""The decoder forward pass of every family in the architecture table (edgellama/models)
over memory-mapped GGUF weights and a preallocated KV cache."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba
import numpy as np

from .kernels import rows as K
from .arch import Family, T as WT
from .args import ModelArgs
from .errors import EdgeError
from .gguf import GGUFFile
from .kv_cache import KVCache, check_cache_type, fit_advice, make_cache
from .kernels import attention as A
from .formats import SUPPORTED, Linear, block_shape, type_name
from .formats.floats import FloatLinear
from .formats.records import RecordLinear
from .machine import ThreadPolicy, available_memory
from .scratch import Scratch
from .tile_cache import TileCache

# How x is rounded for the integer matrix products. int8: every matrix multiplies x rounded
# to int8 per block of 32, as llama.cpp does (it rounds per 256 for the K-quants). fine: the
# record formats' matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K,
# Q6_K, IQ4_XS) multiply x as int8 plus its int8 residual (x within amax/64,516 a block) in the same pass over the weights: closer to
# full precision, for the second row's arithmetic (bench/bench_activations.py). BF16
# weights' prefill, where the CPU has bf16 pair products, rounds x to bf16 as llama.cpp
# does; fine keeps it in f32.
ACTIVATIONS = ("int8", "fine")

if TYPE_CHECKING:
    from .sequence import Sequence

DEFAULT_BATCH = 512   # prefill chunk: taller products run faster ("prefill chunk",
                      # bench/results/design_measurements.json)


@dataclass
class Layer:
    attn_norm: np.ndarray      # (E,) f32
    ffn_norm: np.ndarray       # (E,) f32
    wqkv: list[Linear]         # (H·hd + 2·KV·hd, E): q, k, v rows stacked (one launch)
    wo: Linear                 # (E, H·hd)
    w_gate_up: list[Linear]    # (2F, E): gate and up rows stacked
    w_down: Linear             # (E, F)
    q_norm: np.ndarray | None = None   # (hd,) f32, families with qk_norm
    k_norm: np.ndarray | None = None   # (hd,) f32
    post_attn_norm: np.ndarray | None = None   # (E,) f32, families with post_norms
    post_ffn_norm: np.ndarray | None = None    # (E,) f32


def _activations(sc: Scratch, a: ModelArgs, T: int):
    """The activation buffers of a pass over T tokens, from the scratch."""
    f = np.float32
    return (sc.get("x", (T, a.dim)),                       # residual stream
            sc.get("h", (T, a.dim)),                       # normed input of a sublayer
            sc.get("qkv", (T, a.n_heads * a.head_dim + 2 * a.kv_dim)),
            sc.get("att", (T, a.n_heads * a.head_dim)),
            sc.get("o", (T, a.dim)),                       # sublayer output
            sc.get("gate_up", (T, 2 * a.ffn_dim)),
            sc.get("act", (T, a.ffn_dim), f))              # silu(gate) * up


def _linear(x: np.ndarray, w: Linear, out: np.ndarray, sc: Scratch, decode: bool) -> None:
    # x (T, in) -> out (T, out): one matvec for one token, a weight pass for a batch of
    # decoded tokens (several sequences), a batched matmul for prefill
    if x.shape[0] == 1:
        w.matvec(x[0], out[0], sc)
    elif decode:
        w.matvecs(x, out, sc)
    else:
        w.matmul(x, out, sc)


def _linears(x: np.ndarray, ws: list[Linear], out: np.ndarray, sc: Scratch, decode: bool) -> None:
    # x (T, in) -> out (T, Σ out_features): each stacked Linear fills its columns
    if len(ws) == 1:
        _linear(x, ws[0], out, sc, decode)
        return
    c = 0
    for w in ws:
        _linear(x, w, out[:, c:c + w.out_features], sc, decode)
        c += w.out_features


def check_tensors(g: GGUFFile, args: ModelArgs) -> None:
    """Every tensor a model of this family with these hyperparameters needs, with its
    shape and a supported type, and nothing else."""
    want = args.expected_shapes()
    missing = [n for n in want if n not in g.tensors]
    extra = [n for n in g.tensors if n not in want]
    if missing or extra:
        what = (f"missing {', '.join(missing[:3])}" if missing else "") + \
               ("; " if missing and extra else "") + \
               (f"unexpected {', '.join(extra[:3])}" if extra else "")
        raise EdgeError(f"{g.path}: tensors do not match a {args.family.name} model with "
                        f"these hyperparameters: {what}")
    for name, shape in want.items():
        t = g.tensors[name]
        if t.shape != shape:
            raise EdgeError(f"{g.path}: tensor {name} has shape {list(t.shape)}, "
                            f"expected {list(shape)} from the metadata")
        if type_name(t.type_id) not in SUPPORTED:
            raise EdgeError(f"{g.path}: tensor {name} has type {t.type_name}, which edgellama "
                            f"does not run (it runs {', '.join(SUPPORTED)}); download the model "
                            f"as a GGUF in one of those types (Q4_K_M is the common one), or "
                            f"convert its Hugging Face checkpoint with `edgellama convert`")


class Transformer:
    """A model's weights, read-only once loaded: any number of sequences
    (new_sequence) run through it, one at a time or several decoded together (decode).
    It keeps no state of a run; batch is the prefill chunk, ctx the longest sequence."""

    def __init__(self, gguf: GGUFFile, ctx: int, batch: int = DEFAULT_BATCH,
                 args: ModelArgs | None = None, threads: ThreadPolicy | None = None,
                 activations: str = "int8", cache_type_k: str = "f16", cache_type_v: str = "f16"):
        self.gguf = gguf
        # None: Numba's current thread count, fixed
        self.threads = threads or ThreadPolicy(numba.get_num_threads())
        self.args = a = args or ModelArgs.from_gguf(gguf)
        check_tensors(gguf, a)
        # the sequences' default cache types
        self.cache_type_k = check_cache_type(cache_type_k, a.head_dim)
        self.cache_type_v = check_cache_type(cache_type_v, a.head_dim)
        need = KVCache.bytes_needed(a, ctx, self.cache_type_k, self.cache_type_v)
        avail = available_memory()
        if avail is not None and need > avail:
            raise EdgeError(fit_advice(a, ctx, self.cache_type_k, self.cache_type_v, avail))
        self.ctx = ctx
        self.batch = batch = max(1, min(batch, ctx))
        self._tiles = TileCache(gguf.path, sum(t.nbytes for t in gguf.tensors.values()
                                               if block_shape(t.type_id)[0] > 1))
        n = Family.tensor
        try:
            self.embed = self._linear(n(WT.TOKEN_EMBD))
            self.output = self.embed if a.tied_output else self._linear(n(WT.OUTPUT))
            self.output_norm = self._vector(n(WT.OUTPUT_NORM))
            self.layers = [self._layer(i) for i in range(a.n_layers)]
        except BaseException:
            self._tiles.close()      # no tile file from a load that failed
            raise
        self._tiles.finish()
        self.set_activations(activations)
        self.inv_freq = a.inv_freq()
        self.inv_freq_local = a.inv_freq(local=True)    # sliding-window layers'

    def new_sequence(self, ctx: int | None = None, scratch: Scratch | None = None,
                     type_k: str | None = None, type_v: str | None = None) -> Sequence:
        """An empty sequence for this model: a KV cache of `ctx` positions (default and
        most: the model's ctx) with K and V in the given cache types (default: the
        model's, kv_cache.CACHE_TYPES), and a scratch of its own unless one is given to
        share."""
        from .sequence import Sequence
        ctx = self.ctx if ctx is None else ctx
        if not 1 <= ctx <= self.ctx:
            raise EdgeError(f"a sequence's context must be 1..{self.ctx} tokens, got {ctx}")
        return Sequence(make_cache(self.args, ctx, type_k or self.cache_type_k,
                                   type_v or self.cache_type_v, neox=self.args.family.neox), scratch)

    def set_activations(self, mode: str) -> None:
        """Round x for the matrix products as ACTIVATIONS' mode says."""
        if mode not in ACTIVATIONS:
            raise EdgeError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {mode!r}")
        self.activations = mode
        for w in self.linears():
            if isinstance(w, (RecordLinear, FloatLinear)):
                w.fine = mode == "fine"

    # -- loading -------------------------------------------------------------
    def wait_for_tiles(self) -> None:
        """Until a first load's start-up tile file is written (tile_cache.py): benchmarks
        time nothing while it is, as the writing takes CPU and memory bandwidth."""
        self._tiles.wait()

    def _layer(self, i: int) -> Layer:
        n, qk, post = Family.tensor, self.args.family.qk_norm, self.args.family.post_norms
        return Layer(self._vector(n(WT.ATTN_NORM, i)), self._vector(n(WT.FFN_NORM, i)),
                     self._stacked(n(WT.ATTN_Q, i), n(WT.ATTN_K, i), n(WT.ATTN_V, i)),
                     self._linear(n(WT.ATTN_OUT, i)),
                     self._stacked(n(WT.FFN_GATE, i), n(WT.FFN_UP, i)),
                     self._linear(n(WT.FFN_DOWN, i)),
                     self._vector(n(WT.ATTN_Q_NORM, i)) if qk else None,
                     self._vector(n(WT.ATTN_K_NORM, i)) if qk else None,
                     self._vector(n(WT.ATTN_POST_NORM, i)) if post else None,
                     self._vector(n(WT.FFN_POST_NORM, i)) if post else None)

    def _linear(self, name: str) -> Linear:
        t = self.gguf.tensors[name]
        return self._tiles.linear(name, t.type_id, [(self.gguf.tensor_bytes(name), t.shape)])

    def _stacked(self, *names: str) -> list[Linear]:
        """Matrices applied to the same input, rows stacked so one launch does them all;
        a run of tensors of another type (mixed-type files) gets a Linear of its own."""
        out, run = [], []
        for t in (self.gguf.tensors[n] for n in names):
            if run and t.type_id != run[0].type_id:
                out.append(run)
                run = []
            run.append(t)
        out.append(run)
        return [self._tiles.linear("|".join(t.name for t in r), r[0].type_id,
                                   [(self.gguf.tensor_bytes(t.name), t.shape) for t in r])
                for r in out]

    def _vector(self, name: str) -> np.ndarray:
        t = self.gguf.tensors[name]
        if t.type_name != "F32":
            raise EdgeError(f"{self.gguf.path}: tensor {name} is {t.type_name}; "
                            f"1-D tensors must be F32")
        return self.gguf.tensor_bytes(name).view(np.float32).reshape(-1)

    def layer_linears(self, layer: Layer) -> list[Linear]:
        return [*layer.wqkv, layer.wo, *layer.w_gate_up, layer.w_down]

    def linears(self) -> list[Linear]:
        """Every matrix a decoded token multiplies: all layers' and the output's."""
        return [w for layer in self.layers for w in self.layer_linears(layer)] + [self.output]

    def type_summary(self) -> str:
        """Weight types by tensor count, most common first, e.g. "Q4_1 ×210, Q8_0 ×1"."""
        c = Counter(t.type_name for t in self.gguf.tensors.values() if len(t.shape) > 1)
        return ", ".join(f"{n} ×{k}" for n, k in c.most_common())

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.gguf.tensors.values())

    # -- inference -----------------------------------------------------------
    def forward(self, tokens, seq: Sequence, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` through the model at the sequence's next positions (seq.pos..),
        extending its KV cache and token ids (truncate it first to overwrite).

        Returns the logits of the last token (V,), or (T, V) with all_logits. The
        last token's logits are a buffer of seq.scratch reused by the next call: copy
        them to keep them.
        """
        tokens = self._check(tokens)
        T, pos = len(tokens), seq.pos
        if T == 0:
            raise ValueError("forward() needs at least one token")
        if pos + T > seq.ctx:
            raise EdgeError(f"{T} tokens at position {pos} do not fit the context of "
                            f"{seq.ctx} tokens")
        self.threads.apply(min(T, self.batch))
        all_out = np.empty((T, self.args.vocab_size), np.float32) if all_logits else None
        for start in range(0, T, self.batch):
            chunk = tokens[start:start + self.batch]
            out = None if all_out is None else all_out[start:start + len(chunk)]
            last = self._run(chunk, [seq], [len(chunk)], seq.scratch, False, out)
        return all_out if all_logits else last[0]

    def decode(self, seqs: list[Sequence], tokens, scratch: Scratch | None = None,
               counts: list[int] | None = None) -> np.ndarray:
        """One token for each of several sequences (at their own positions and lengths)
        in one pass over the weights; attention reads each sequence's own cache. With
        `counts`, counts[i] tokens for seqs[i] (tokens in that order): the server's step
        where some sequences verify proposals (verify()'s rows, beside the others').

        Returns logits (sum(counts), V), a row per token in `tokens`' order: a buffer of
        `scratch` (default seqs[0].scratch) reused by the next call.
        """
        tokens = self._check(tokens)
        counts = [1] * len(seqs) if counts is None else list(counts)
        if len(counts) != len(seqs) or not seqs or min(counts) < 1 \
                or len(tokens) != sum(counts):
            raise ValueError(f"decode() needs one token per sequence (with counts, counts[i] "
                             f">= 1 for seqs[i]), got {len(tokens)} for {len(seqs)}")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("decode() got a sequence twice")
        for s, n in zip(seqs, counts):
            if s.pos + n > s.ctx:
                raise EdgeError(f"a sequence is full ({s.ctx} tokens)")
        sc = scratch or seqs[0].scratch
        self.threads.apply(len(tokens))
        return self._run(tokens, seqs, counts, sc, True,
                         sc.get("logits_n", (len(tokens), self.args.vocab_size)))

    def verify(self, tokens, seq: Sequence) -> np.ndarray:
        """Logits (T, V) of a few tokens at the sequence's next positions, extending it
        as forward() does: speculative decoding's check of proposed tokens. It runs
        decode's kernels, so every row is exactly what forward() of that one token
        computes; the record formats (one_pass_verify) read the weights once for all
        rows, the others run one matvec per row. A buffer of seq.scratch."""
        tokens = self._check(tokens)
        T = len(tokens)
        if T == 0:
            raise ValueError("verify() needs at least one token")
        if seq.pos + T > seq.ctx:
            raise EdgeError(f"{T} tokens at position {seq.pos} do not fit the context of "
                            f"{seq.ctx} tokens")
        self.threads.apply(T)
        return self._run(tokens, [seq], [T], seq.scratch, True,
                         seq.scratch.get("logits_verify", (T, self.args.vocab_size)))

    @property
    def one_pass_verify(self) -> bool:
        """Whether verify() reads the weights once for several tokens: every matrix has a
        multi-token decode kernel (the record formats), not a matvec per token."""
        return all(type(w).matvecs is not Linear.matvecs for w in self.linears())

    def _check(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.args.vocab_size):
            raise EdgeError(f"token id out of range 0..{self.args.vocab_size - 1}")
        return tokens

    def _run(self, tokens: np.ndarray, seqs: list[Sequence], counts: list[int], sc: Scratch,
             decode: bool, logits: np.ndarray | None) -> np.ndarray:
        # tokens (T,): counts[i] of them for seqs[i], at its next positions. Every Linear
        # runs once over all T rows (decode: with the few-token kernels); RoPE's angles
        # are per row; K/V writes and attention per sequence. logits (T, V) gets every
        # row's logits; None: the last row's only, into a (1, V) buffer of sc, returned.
        a = self.args
        T, hd = len(tokens), a.head_dim
        qd, kvd = a.n_heads * hd, a.kv_dim
        x, h, qkv, att, o, gate_up, act = _activations(sc, a, T)
        starts = np.cumsum([0] + counts[:-1]).tolist()
        positions = np.concatenate([np.arange(s.pos, s.pos + n) for s, n in zip(seqs, counts)])
        local = a.local_layers
        rot = {}                # (cos, sin) of the global layers' frequencies, the local ones'
        for is_local in set(local):
            f = self.inv_freq_local if is_local else self.inv_freq
            angles = positions.astype(np.float64)[:, None] * f[None, :]
            rot[is_local] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        scale = np.float32(a.attn_scale)
        att_scratch = tuple(sc.get(f"attention_{i}", shape, dt) for i, (shape, dt) in enumerate(
            A.attention_scratch_shapes(numba.config.NUMBA_NUM_THREADS, a.n_heads, a.n_kv_heads, hd)))
        att3 = att.reshape(T, a.n_heads, hd)
        E = K.elementwise(T)
        rope, qk_norm = (E.rope_neox if a.family.neox else E.rope), a.family.qk_norm
        act_fn = E.geglu if a.family.activation == "geglu" else E.swiglu
        self.embed.rows(tokens, x)
        if a.family.embed_scale:
            x *= np.float32(np.sqrt(a.dim))
        q3 = qkv[:, :qd].reshape(T, a.n_heads, hd)
        k3 = qkv[:, qd:qd + kvd].reshape(T, a.n_kv_heads, hd)
        v3 = qkv[:, qd + kvd:].reshape(T, a.n_kv_heads, hd)
        # each sequence's cache, first position and rows (r0:r1 of the batch)
        runs = [(s.cache, s.pos, slice(r0, r0 + n)) for s, r0, n in zip(seqs, starts, counts)]
        for li, layer in enumerate(self.layers):
            cos, sin = rot[local[li]]
            E.rmsnorm(x, layer.attn_norm, a.norm_eps, h)
            _linears(h, layer.wqkv, qkv, sc, decode)
            if qk_norm:
                E.head_norm(qkv, 0, a.n_heads, layer.q_norm, a.norm_eps)
                E.head_norm(qkv, qd, a.n_kv_heads, layer.k_norm, a.norm_eps)
            rope(q3, cos, sin)
            rope(k3, cos, sin)
            for cache, p0, r in runs:
                cache.step(li, p0, q3[r], k3[r], v3[r], scale, att3[r], att_scratch)
            _linear(att, layer.wo, o, sc, decode)
            self._residual(E, x, o, h, layer.post_attn_norm)
            E.rmsnorm(x, layer.ffn_norm, a.norm_eps, h)
            _linears(h, layer.w_gate_up, gate_up, sc, decode)
            act_fn(gate_up, act)
            _linear(act, layer.w_down, o, sc, decode)
            self._residual(E, x, o, h, layer.post_ffn_norm)
        for s, r0, n in zip(seqs, starts, counts):
            s._extend(tokens[r0:r0 + n])
        if logits is None:      # prefill: only the last token's logits are wanted
            K.rmsnorm(x[T - 1:T], self.output_norm, a.norm_eps, h[:1])
            logits = sc.get("logits", (1, a.vocab_size))
            self.output.matvec(h[0], logits[0], sc)
        else:
            E.rmsnorm(x, self.output_norm, a.norm_eps, h)
            _linear(h, self.output, logits, sc, decode)
        if a.final_softcap:
            K.softcap(logits, a.final_softcap)
        return logits

    def _residual(self, E, x: np.ndarray, o: np.ndarray, h: np.ndarray, post_norm) -> None:
        # x += o, a sublayer's output (T, E); with a post-norm (Gemma), its RMSNorm (in h)
        if post_norm is None:
            E.add(x, o)
        else:
            E.rmsnorm(o, post_norm, self.args.norm_eps, h)
            E.add(x, h)
