"""ModelArgs: every hyperparameter, read once from GGUF metadata, nothing hard-coded."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType

from .errors import EdgeError
from .gguf import GGUFFile

U32_ISH = (4, 10, 5, 11)   # llama.cpp accepts any integer type for these; so do we
FLOAT = (6, 12)

SUPPORTED_ARCHS = ("llama",)


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
    rope_dim: int            # rotated dims per head (== head_dim for Llama)
    train_ctx: int           # llama.context_length
    tied_output: bool        # no output.weight: token_embd doubles as the output matrix
    rope_freqs: np.ndarray | None = None   # (rope_dim/2,) f32 divisors (llama3 scaling)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def inv_freq(self) -> np.ndarray:
        """(rope_dim/2,) f32 rotation frequency of each adjacent pair, scaling applied."""
        i = np.arange(0, self.rope_dim, 2, dtype=np.float64)
        f = 1.0 / (self.rope_theta ** (i / self.rope_dim))
        if self.rope_freqs is not None:
            f = f / self.rope_freqs.astype(np.float64)
        return f.astype(np.float32)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelArgs":
        arch = g.require("general.architecture", (8,))
        if arch not in SUPPORTED_ARCHS:
            raise EdgeError(f"{g.path}: architecture {arch!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHS)})")

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
        if dim % n_heads or n_heads % n_kv:
            raise EdgeError(f"{g.path}: embedding_length {dim}, head_count {n_heads} and "
                            f"head_count_kv {n_kv} are inconsistent (need E % H == 0, H % KV == 0)")
        head_dim = dim // n_heads
        if head_dim % 2:
            raise EdgeError(f"{g.path}: head dim {head_dim} (embedding_length / head_count) "
                            f"must be even for rotary embeddings")
        rope_dim = num("rope.dimension_count", default=head_dim)
        if rope_dim != head_dim:
            raise EdgeError(f"{g.path}: rope.dimension_count {rope_dim} != head dim {head_dim} "
                            f"(partial rotary embeddings are not supported)")
        embd = g.tensors.get("token_embd.weight")
        vocab = num("vocab_size", default=embd.shape[0] if embd else None)
        freqs = None
        if "rope_freqs.weight" in g.tensors:
            t = g.tensors["rope_freqs.weight"]
            if t.type_id != GGMLQuantizationType.F32 or t.shape != (rope_dim // 2,):
                raise EdgeError(f"{g.path}: rope_freqs.weight must be F32 [{rope_dim // 2}], "
                                f"got {t.type_name} {list(t.shape)}")
            freqs = g.tensor_bytes("rope_freqs.weight").view(np.float32).reshape(-1).copy()
            if not np.all(np.isfinite(freqs)) or np.any(freqs <= 0):
                raise EdgeError(f"{g.path}: rope_freqs.weight holds non-positive or non-finite values")
        n_layers = num("block_count")
        if n_layers * 9 > len(g.tensors):
            raise EdgeError(f"{g.path}: block_count {n_layers} needs {n_layers * 9} layer tensors, "
                            f"but the file has {len(g.tensors)} tensors in all")
        eps = float(num("attention.layer_norm_rms_epsilon", FLOAT))
        theta = float(num("rope.freq_base", FLOAT, default=10000.0))
        if not (0 < eps < 1) or not theta > 0:
            raise EdgeError(f"{g.path}: rms epsilon {eps} or rope base {theta} out of range")
        return cls(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            ffn_dim=num("feed_forward_length"), vocab_size=vocab, norm_eps=eps,
            rope_theta=theta, rope_dim=rope_dim, train_ctx=num("context_length"),
            tied_output="output.weight" not in g.tensors, rope_freqs=freqs,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a llama GGUF must hold, with its NumPy-order shape."""
        E, F, V, hd = self.dim, self.ffn_dim, self.vocab_size, self.head_dim
        shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
        if not self.tied_output:
            shapes["output.weight"] = (V, E)
        if self.rope_freqs is not None:
            shapes["rope_freqs.weight"] = (self.rope_dim // 2,)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            shapes.update({
                p + "attn_norm.weight": (E,), p + "ffn_norm.weight": (E,),
                p + "attn_q.weight": (self.n_heads * hd, E),
                p + "attn_k.weight": (self.kv_dim, E), p + "attn_v.weight": (self.kv_dim, E),
                p + "attn_output.weight": (E, self.n_heads * hd),
                p + "ffn_gate.weight": (F, E), p + "ffn_up.weight": (F, E),
                p + "ffn_down.weight": (E, F),
            })
        return shapes
