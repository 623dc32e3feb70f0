"""A helper process of jit.compile_in_processes: compiles the kernels its parent sends
into the kernel cache the two share, and answers each group with one JSON line.

    python -m edgellama.kernels.compile_child

stdin: one group a line, base64 of a pickled list of (module, attribute, key, signature):
the kernel is module.attribute (key None) or module.attribute[key] (a dict of the kernels
a factory makes per weight type), the signature Numba's argument types. The pickle comes
from the parent that started this process, never from a file. stdout: per group
{"seconds": how long it took} or {"error": "..."}; the parent compiles whatever a
group's error left out itself, and says why if it fails there too.
"""
from __future__ import annotations

import base64
import importlib
import json
import pickle
import sys
import time


def main() -> None:
    import edgellama  # noqa: F401 - points Numba at the kernel cache, as in the parent
    for line in sys.stdin:
        group = pickle.loads(base64.b64decode(line))     # noqa: S301 - our parent's pipe
        t0 = time.perf_counter()
        try:
            for module, attr, key, sig in group:
                kernel = getattr(importlib.import_module(module), attr)
                (kernel if key is None else kernel[key]).compile(sig)
            reply = {"seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - the parent compiles it and reports
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
