"""The CPU Numba compiles our kernels for, which is not always the CPU they run on.

Numba targets the host unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise
(NUMBA_CPU_NAME=generic, for a kernel cache shared between machines, empties the
features; NUMBA_ENABLE_AVX=0 drops AVX). Every instruction choice in the kernels follows
these features, not the host's: LLVM aborts the whole process on an intrinsic its target
lacks, and lowers a half-precision conversion it has no instruction for to a library
call that Numba's JIT cannot link.
"""
from __future__ import annotations

from llvmlite import binding as llvm
from numba.core import config
from numba.core.codegen import get_host_cpu_features

from .isa import ARCH, ISAS, target_isa


def target_features() -> set[str]:
    """The features Numba compiles for, e.g. {"avx2", "f16c", ...}."""
    flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


FEATURES = target_features()
# LLVM's name of the CPU Numba compiles for (as its kernel cache is keyed), e.g. "znver5"
CPU_NAME = config.CPU_NAME or llvm.get_host_cpu_name()
_ARCH = ARCH
# The instruction set the kernels lower to (isa.py's table): its index, the constant the
# tile intrinsics take, and its row
ISA = target_isa(FEATURES)
TARGET = ISAS[ISA]
# f16 <-> f32 in one instruction (fp.py): F16C on x86, always on AArch64
HALF_NATIVE = TARGET.half_native(FEATURES)
# BF16 weights' prefill on bf16 pair products (float_gemm.bf16_tile): AVX512_BF16
BF16_PAIRS = TARGET.has_bf16_pairs(FEATURES)
