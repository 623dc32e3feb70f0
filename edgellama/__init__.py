"""edgellama: quantized Llama inference on ordinary CPUs (GGUF, NumPy + Numba)."""
import importlib
import importlib.abc
import importlib.util
import sys

from .errors import EdgeError

__all__ = ["EdgeError", "LLM", "SamplingParams", "load", "json_schema_grammar",
           "parse_tool_calls"]

# The public API loads numpy and numba on first use, so the CLI parses its arguments
# (and prints --help) without paying for them.
_LAZY = {"LLM": ".llm", "load": ".llm", "SamplingParams": ".sampling",
         "json_schema_grammar": ".constrain", "parse_tool_calls": ".tool_calls"}


def __getattr__(name):
    if name == "hub":             # `edgellama.hub.gguf_path(...)` after `import edgellama`
        return importlib.import_module(".hub", __name__)
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


class _KernelCacheSetup(importlib.abc.MetaPathFinder):
    """Points Numba's cache at ours (kernels/jit.py: prepare_numba) once numba and that module are
    imported, before any module with kernels defines them. Importing numba here instead
    would cost every import of edgellama (and `edgellama --help`) a third of a second."""

    def __init__(self):
        self.jit = f"{__name__}.kernels.jit"
        self.waiting = {"numba", self.jit}

    def find_spec(self, name, path=None, target=None):
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            if find is not None and (spec := find(name, path, target)) is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.loaded(name)
        spec.loader.exec_module = exec_module
        return spec

    def loaded(self, name):
        self.waiting.discard(name)
        if not self.waiting:
            sys.meta_path.remove(self)
            sys.modules[self.jit].prepare_numba()
        elif name == "numba" and self.jit not in sys.modules:
            importlib.import_module(self.jit)   # its own exec ends the setup
        # else: jit is the module importing numba; the setup runs when jit is done


if "numba" in sys.modules:
    from .kernels.jit import prepare_numba as _prepare_numba
    _prepare_numba()
else:
    sys.meta_path.insert(0, _KernelCacheSetup())
