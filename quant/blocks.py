"""Block layouts, declared once and used by every reader and writer.

Sizes of every GGML type (so a reader can validate files holding types we do not
run) come from gguf-py's table; the types we quantize, dequantize and compute with
are declared here with their byte layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType


@dataclass(frozen=True)
class BlockFormat:
    name: str
    type_id: int          # GGMLQuantizationType value stored in the file
    block_size: int       # elements per block
    type_size: int        # bytes per block
    file_type: int        # general.file_type when (most) weights use this format
    layout: str           # byte layout of one block, little-endian


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("F32", 0, 1, 4, LlamaFileType.ALL_F32, "f32"),
        BlockFormat("F16", 1, 1, 2, LlamaFileType.MOSTLY_F16, "f16 (IEEE half)"),
        BlockFormat("BF16", 30, 1, 2, LlamaFileType.MOSTLY_BF16, "bf16 (top half of f32)"),
        BlockFormat("Q4_0", 2, 32, 18, LlamaFileType.MOSTLY_Q4_0, "d:f16, qs:u8[16]; x=(nibble-8)*d"),
        BlockFormat("Q4_1", 3, 32, 20, LlamaFileType.MOSTLY_Q4_1, "d:f16, m:f16, qs:u8[16]; x=nibble*d+m"),
        BlockFormat("Q8_0", 8, 32, 34, LlamaFileType.MOSTLY_Q8_0, "d:f16, qs:i8[32]; x=q*d"),
    )
}
BY_ID: dict[int, BlockFormat] = {f.type_id: f for f in FORMATS.values()}

# Element j of a 4-bit block: j < 16 is the low nibble of qs[j], j >= 16 the high
# nibble of qs[j - 16].
QK = 32


def type_name(type_id: int) -> str:
    """Name of any GGML type id (ours or not), for messages."""
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type#{type_id}"


def block_shape(type_id: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block) for any known GGML type, else None."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


def row_bytes(type_id: int, n: int) -> int:
    """Bytes of one row of n elements; n must be a multiple of the block size."""
    bs, ts = block_shape(type_id)
    assert n % bs == 0, (type_id, n)
    return n // bs * ts
