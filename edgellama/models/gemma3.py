"""Gemma 3 (text: 270M, 1B; the text layers of 4B to 27B): Qwen 3's per-head q/k RMSNorm
and NEOX RoPE, plus an RMSNorm of each sublayer's output before it is added
(post_attention_norm, post_ffw_norm), GELU-gated feed-forward, the embedding scaled by
sqrt(E), the output tied to it, and five sliding-window layers (rope base 10,000) for
each global one (llama.cpp's gemma3 graph). The file's norm weights already hold
Gemma's 1 + w (llama.cpp's converter adds the 1)."""
from gguf.constants import MODEL_ARCH

from ..arch import ROPE_NEOX, Family

FAMILY = Family(MODEL_ARCH.GEMMA3, rope=ROPE_NEOX, qk_norm=True, activation="geglu",
                post_norms=True, embed_scale=True, swa_pattern=6)
