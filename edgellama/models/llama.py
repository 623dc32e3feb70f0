"""Llama (1, 2, 3.x) and the models that share its layer unchanged (SmolLM2, TinyLlama,
Mistral 7B...): RMSNorm, SwiGLU, adjacent-pair RoPE (the GGUF converter permuted HF's
Q/K rows for it), optional llama3 frequency scaling (rope_freqs.weight)."""
from gguf.constants import MODEL_ARCH

from ..arch import ROPE_NORM, Family

FAMILY = Family(MODEL_ARCH.LLAMA, rope=ROPE_NORM)
