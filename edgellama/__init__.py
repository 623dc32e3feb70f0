"""edgellama: quantized Llama inference on ordinary CPUs (GGUF, NumPy + Numba)."""
from .jit import use_user_cache as _use_user_cache

_use_user_cache()   # before any module with kernels is imported

from .errors import EdgeError  # noqa: E402
from .llm import LLM, load  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["EdgeError", "LLM", "SamplingParams", "load"]
