"""The architecture table's entries: what a model family (general.architecture) is made of.

Each family is one module in edgellama/models/ declaring a Family; models/__init__.py is
the registry the loader reads. Shared by every family: the hyperparameters ModelArgs
reads from `<arch>.*` metadata (head dim from attention.key_length / value_length,
default embedding_length / head_count, as llama.cpp), and the decoder layer model.py
runs: RMSNorm, attention (GQA over the KV cache), RMSNorm, feed-forward, each added to
the residual. A Family says which of the optional blocks its layers have and which
variant of each shared block it uses (Gemma 3: a norm of each sublayer's output, GELU,
the scaled embedding, sliding-window layers). Tensor names come from gguf-py's tables
(MODEL_TENSORS, TENSOR_NAMES), never retyped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

# RoPE layouts, by llama.cpp's names. NORM rotates adjacent pairs (2i, 2i+1): GGUF llama
# files (llama.cpp's converter permutes HF's Q/K rows into it). NEOX rotates halves,
# pairs (i, i + hd/2): HF's rotate_half, rows as HF has them (Qwen, Gemma, ...).
ROPE_NORM = "norm"
ROPE_NEOX = "neox"
NORMS = ("rms",)             # what model.py runs; a family naming another is refused
ACTIVATIONS = ("swiglu",      # silu(gate) * up
               "geglu")      # gelu(gate) * up, GELU's tanh form (ggml_gelu, HF gelu_pytorch_tanh)

T = MODEL_TENSOR
# Every family's layer: pre-norms, attention's four matrices, the gated feed-forward
LAYER = (T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT,
         T.FFN_NORM, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)
QK_NORM = (T.ATTN_Q_NORM, T.ATTN_K_NORM)   # RMSNorm weights (hd,), one per head dim
POST_NORMS = (T.ATTN_POST_NORM, T.FFN_POST_NORM)   # (E,): each sublayer's output normed


@dataclass(frozen=True)
class Family:
    arch: MODEL_ARCH
    rope: str = ROPE_NORM
    qk_norm: bool = False        # each q and k head RMS-normed (weights (hd,)) before RoPE
    norm: str = "rms"
    activation: str = "swiglu"
    post_norms: bool = False     # attention's and the feed-forward's outputs RMS-normed before the add
    embed_scale: bool = False    # the embedding rows times sqrt(E) (Gemma)
    # Sliding-window attention (attention.sliding_window from the file): layer i is local
    # unless (i + 1) % swa_pattern == 0 (llama.cpp's set_swa_pattern); 0: every layer global.
    # Local layers see the last `sliding_window` positions (their own included) and take
    # rope.freq_base_swa, default swa_rope_base, without the file's rope scaling.
    swa_pattern: int = 0
    swa_rope_base: float = 10000.0
    # the family's recommended sampling (SamplingParams fields) when the file has no
    # general.sampling.*; None: llm.py's defaults
    sampling: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        # a mistake in a family module fails at import
        for what, value, known in (("rope layout", self.rope, (ROPE_NORM, ROPE_NEOX)),
                                   ("norm", self.norm, NORMS),
                                   ("activation", self.activation, ACTIVATIONS)):
            if value not in known:
                raise ValueError(f"family {self.name}: {what} {value!r} is not one of {known}")
        unknown = [t.name for t in self.layer_tensors if t not in MODEL_TENSORS[self.arch]]
        if unknown:
            raise ValueError(f"family {self.name}: gguf-py lists no {', '.join(unknown)}")

    @property
    def name(self) -> str:
        """general.architecture, and the prefix of its metadata keys."""
        return MODEL_ARCH_NAMES[self.arch]

    @property
    def neox(self) -> bool:
        return self.rope == ROPE_NEOX

    def local_layers(self, n_layers: int) -> tuple[bool, ...]:
        """Which of n layers attend over the sliding window."""
        p = self.swa_pattern
        return tuple(bool(p) and (i + 1) % p != 0 for i in range(n_layers))

    @property
    def layer_tensors(self) -> tuple[MODEL_TENSOR, ...]:
        """The tensors each layer holds."""
        if not self.post_norms:
            return LAYER + (QK_NORM if self.qk_norm else ())
        # gguf-py calls ffn_norm FFN_PRE_NORM in the families with a post-norm beside it
        return tuple(T.FFN_PRE_NORM if t == T.FFN_NORM else t for t in LAYER) + \
            (QK_NORM if self.qk_norm else ()) + POST_NORMS

    @staticmethod
    def tensor(t: MODEL_TENSOR, layer: int | None = None) -> str:
        """A weight's name in the file: gguf-py's name for `t` (in layer `layer`)."""
        return TENSOR_NAMES[t].format(bid=layer) + ".weight"
