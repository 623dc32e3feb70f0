"""edgellama: quantized Llama inference on ordinary CPUs (GGUF, NumPy + Numba)."""
from .errors import EdgeError
from .llm import LLM, load
from .sampling import SamplingParams

__all__ = ["EdgeError", "LLM", "SamplingParams", "load"]
