"""Qwen 3 (dense: 0.6B to 32B): Llama's layer plus an RMSNorm of each q and k head before
RoPE (attn_q_norm / attn_k_norm), NEOX RoPE (HF's rotate_half, rows unpermuted), a head
dim of its own (attention.key_length: 128 for 0.6B, whose 1024 / 16 heads is 64), and
the output matrix tied to the embeddings when the file has no output.weight."""
from gguf.constants import MODEL_ARCH

from ..arch import ROPE_NEOX, Family

# Qwen's recommendation for thinking mode (generation_config.json; ollama's too)
FAMILY = Family(MODEL_ARCH.QWEN3, rope=ROPE_NEOX, qk_norm=True,
                sampling={"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0})
