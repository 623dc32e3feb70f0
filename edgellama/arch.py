"""The architecture table's entries: what a model family (general.architecture) is made of.

Each family is one module in edgellama/models/ declaring a Family; models/__init__.py is
the registry the loader reads. Shared by every family: the hyperparameters ModelArgs
reads from `<arch>.*` metadata (head dim from attention.key_length / value_length,
default embedding_length / head_count, as llama.cpp), and the decoder layer model.py
runs: RMSNorm, attention (GQA over the KV cache), RMSNorm, feed-forward, each added to
the residual. A Family says which of the optional blocks its layers have and which
variant of each shared block it uses. Tensor names come from gguf-py's tables
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
ACTIVATIONS = ("swiglu",)    # silu(gate) * up

T = MODEL_TENSOR
# Every family's layer: pre-norms, attention's four matrices, the gated feed-forward
LAYER = (T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT,
         T.FFN_NORM, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)
QK_NORM = (T.ATTN_Q_NORM, T.ATTN_K_NORM)   # RMSNorm weights (hd,), one per head dim


@dataclass(frozen=True)
class Family:
    arch: MODEL_ARCH
    rope: str = ROPE_NORM
    qk_norm: bool = False        # each q and k head RMS-normed (weights (hd,)) before RoPE
    norm: str = "rms"
    activation: str = "swiglu"
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

    @property
    def layer_tensors(self) -> tuple[MODEL_TENSOR, ...]:
        """The tensors each layer holds."""
        return LAYER + (QK_NORM if self.qk_norm else ())

    @staticmethod
    def tensor(t: MODEL_TENSOR, layer: int | None = None) -> str:
        """A weight's name in the file: gguf-py's name for `t` (in layer `layer`)."""
        return TENSOR_NAMES[t].format(bid=layer) + ".weight"
