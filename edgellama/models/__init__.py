"""The architecture table: every model family edgellama runs, by general.architecture.

Adding a family: a module here declaring FAMILY (edgellama/arch.py says what a Family
holds), its line below, and its tests (a tiny random file of its shape through
tests/tiny_gguf.py against tests/reference.py). A block no family had before goes into
model.py's layer behind the Family flag that asks for it.
"""
from __future__ import annotations

from ..arch import Family
from . import gemma3, llama, qwen3

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen3.FAMILY, gemma3.FAMILY)}
