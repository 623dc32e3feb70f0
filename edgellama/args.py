"""ModelArgs: every hyperparameter, read once from GGUF metadata, nothing hard-coded."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType

from .arch import Family, T
from .errors import EdgeError
from .gguf import GGUFFile
from .models import FAMILIES

U32_ISH = (4, 10, 5, 11)   # llama.cpp accepts any integer type for these; so do we
FLOAT = (6, 12)

SUPPORTED_ARCHS = tuple(FAMILIES)


@dataclass(frozen=True)
class ModelArgs:
    dim: int                 # embedding length E
    n_layers: int
    n_heads: int             # query heads H
    n_kv_heads: int          # key/value heads KV (GQA: H % KV == 0)
    ffn_dim: int             # F
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_dim: int            # rotated dims per head (== head_dim)
    train_ctx: int           # llama.context_length
    tied_output: bool        # no output.weight: token_embd doubles as the output matrix
    rope_freqs: np.ndarray | None = None   # (rope_dim/2,) f32 divisors (llama3 scaling)
    family: Family = FAMILIES["llama"]     # the architecture table's entry (edgellama/models)
    key_length: int | None = None          # attention.key_length: a head dim not E / H
    sliding_window: int = 0                # local layers' window (family.swa_pattern); 0: none
    rope_theta_swa: float = 10000.0        # the local layers' rope base
    rope_scale: float = 1.0                # linear rope scaling (rope.scaling.factor): global layers
    final_softcap: float = 0.0             # logits -> c tanh(logits / c) (final_logit_softcapping)
    query_scale_dim: int | None = None     # attention scale 1/sqrt(this), where not the head dim

    @property
    def head_dim(self) -> int:
        return self.key_length or self.dim // self.n_heads

    @property
    def group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends over the sliding window only."""
        if not self.sliding_window:
            return (False,) * self.n_layers
        return self.family.local_layers(self.n_layers)

    @property
    def attn_scale(self) -> float:
        return 1.0 / np.sqrt(self.query_scale_dim or self.head_dim)

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """(rope_dim/2,) f32 rotation frequency of each rotated pair, scaling applied;
        local: a sliding-window layer's (its own base, no linear scaling, as llama.cpp)."""
        i = np.arange(0, self.rope_dim, 2, dtype=np.float64)
        f = 1.0 / ((self.rope_theta_swa if local else self.rope_theta) ** (i / self.rope_dim))
        if self.rope_freqs is not None:
            f = f / self.rope_freqs.astype(np.float64)
        if not local and self.rope_scale != 1.0:
            f = f / self.rope_scale
        return f.astype(np.float32)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelArgs":
        arch = g.require("general.architecture", (8,))
        if arch not in FAMILIES:
            raise EdgeError(f"{g.path}: architecture {arch!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        family = FAMILIES[arch]

        def num(key, types=U32_ISH, default=None):
            full = f"{arch}.{key}"
            if default is not None and full not in g.metadata:
                return default
            v = g.require(full, types)
            if isinstance(v, (int, float)) and v <= 0 and types is U32_ISH:
                raise EdgeError(f"{g.path}: metadata {full} = {v} must be positive")
            return v

        dim, n_heads = num("embedding_length"), num("attention.head_count")
        n_kv = num("attention.head_count_kv", default=n_heads)
        key_len = num("attention.key_length", default=0)      # 0: not in the file
        if (not key_len and dim % n_heads) or n_heads % n_kv:
            raise EdgeError(f"{g.path}: embedding_length {dim}, head_count {n_heads} and "
                            f"head_count_kv {n_kv} are inconsistent (need E % H == 0, H % KV == 0)")
        head_dim = key_len or dim // n_heads
        value_len = num("attention.value_length", default=head_dim)
        if value_len != head_dim:
            raise EdgeError(f"{g.path}: attention.value_length {value_len} != head dim "
                            f"{head_dim} (heads of two sizes are not supported)")
        if head_dim % 2:
            raise EdgeError(f"{g.path}: head dim {head_dim} (attention.key_length, else "
                            f"embedding_length / head_count) must be even for rotary embeddings")
        rope_dim = num("rope.dimension_count", default=head_dim)
        if rope_dim != head_dim:
            raise EdgeError(f"{g.path}: rope.dimension_count {rope_dim} != head dim {head_dim} "
                            f"(partial rotary embeddings are not supported)")
        embd, rf = g.tensors.get(Family.tensor(T.TOKEN_EMBD)), Family.tensor(T.ROPE_FREQS)
        vocab = num("vocab_size", default=embd.shape[0] if embd else None)
        freqs = None
        if rf in g.tensors:
            t = g.tensors[rf]
            if t.type_id != GGMLQuantizationType.F32 or t.shape != (rope_dim // 2,):
                raise EdgeError(f"{g.path}: {rf} must be F32 [{rope_dim // 2}], "
                                f"got {t.type_name} {list(t.shape)}")
            freqs = g.tensor_bytes(rf).view(np.float32).reshape(-1).copy()
            if not np.all(np.isfinite(freqs)) or np.any(freqs <= 0):
                raise EdgeError(f"{g.path}: {rf} holds non-positive or non-finite values")
        n_layers, per_layer = num("block_count"), len(family.layer_tensors)
        if n_layers * per_layer > len(g.tensors):
            raise EdgeError(f"{g.path}: block_count {n_layers} needs {n_layers * per_layer} layer "
                            f"tensors, but the file has {len(g.tensors)} tensors in all")
        eps = float(num("attention.layer_norm_rms_epsilon", FLOAT))
        theta = float(num("rope.freq_base", FLOAT, default=10000.0))
        if not (0 < eps < 1) or not 0 < theta < math.inf:
            raise EdgeError(f"{g.path}: rms epsilon {eps} or rope base {theta} out of range")
        window = num("attention.sliding_window", default=0) if family.swa_pattern else 0
        theta_swa = float(num("rope.freq_base_swa", FLOAT, default=family.swa_rope_base))
        scale = 1.0
        if g.metadata.get(f"{arch}.rope.scaling.type") == "linear":
            scale = float(num("rope.scaling.factor", FLOAT, default=1.0))
        softcap = float(num("final_logit_softcapping", FLOAT, default=0.0))
        # finite: c tanh(x / c) of an infinite or NaN softcap is NaN in every logit
        if not (0 < theta_swa < math.inf and 0 < scale < math.inf and 0 <= softcap < math.inf):
            raise EdgeError(f"{g.path}: rope.freq_base_swa {theta_swa}, rope.scaling.factor "
                            f"{scale} or final_logit_softcapping {softcap} out of range")
        # llama.cpp's Gemma 27B (62 layers) scales queries by 1/sqrt(E / H), not the head dim
        qdim = dim // n_heads if family.name == "gemma3" and n_layers == 62 else None
        return cls(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            ffn_dim=num("feed_forward_length"), vocab_size=vocab, norm_eps=eps,
            rope_theta=theta, rope_dim=rope_dim, train_ctx=num("context_length"),
            tied_output=Family.tensor(T.OUTPUT) not in g.tensors, rope_freqs=freqs,
            family=family, key_length=None if head_dim * n_heads == dim else head_dim,
            sliding_window=window, rope_theta_swa=theta_swa, rope_scale=scale,
            final_softcap=softcap, query_scale_dim=qdim,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a file of this family must hold, with its NumPy-order shape."""
        E, F, V, hd, f = self.dim, self.ffn_dim, self.vocab_size, self.head_dim, self.family
        qd = self.n_heads * hd
        shapes = {f.tensor(T.TOKEN_EMBD): (V, E), f.tensor(T.OUTPUT_NORM): (E,)}
        if not self.tied_output:
            shapes[f.tensor(T.OUTPUT)] = (V, E)
        if self.rope_freqs is not None:
            shapes[f.tensor(T.ROPE_FREQS)] = (self.rope_dim // 2,)
        block = {T.ATTN_NORM: (E,), T.FFN_NORM: (E,), T.ATTN_Q: (qd, E),
                 T.ATTN_K: (self.kv_dim, E), T.ATTN_V: (self.kv_dim, E), T.ATTN_OUT: (E, qd),
                 T.ATTN_Q_NORM: (hd,), T.ATTN_K_NORM: (hd,), T.FFN_PRE_NORM: (E,),
                 T.ATTN_POST_NORM: (E,), T.FFN_POST_NORM: (E,),
                 T.FFN_GATE: (F, E), T.FFN_UP: (F, E), T.FFN_DOWN: (E, F)}
        for i in range(self.n_layers):
            shapes.update({f.tensor(t, i): block[t] for t in f.layer_tensors})
        return shapes
