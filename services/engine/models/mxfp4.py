"""gpt-oss's published MXFP4 experts, dequantized at load to the layout transformers saves
in bf16.

A tensor ``X`` of R rows and C columns per expert is stored as ``X_blocks`` [E, R, C / 32,
16] uint8 (32 FP4 e2m1 values per block, two per byte, the low nibble first) and
``X_scales`` [E, R, C / 32] uint8 (one e8m0 exponent per block, biased by 127). The value of
nibble n in a block of exponent s is FP4[n] * 2 ** (s - 127). ``X`` is then [E, C, R] (the
rows and columns swapped), as gpt-oss's ``gate_up_proj`` [E, H, 2I] and ``down_proj``
[E, I, H] are laid out.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """blocks [E, R, G, 16] uint8, scales [E, R, G] uint8 -> [E, G * 32, R] in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
            "[E, R, G, 16] and [E, R, G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [E, R, G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # [E, R, G, 32]
    return values.flatten(-2).transpose(1, 2).to(dtype).contiguous()


def dequantize_state(
    state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Every ``X_blocks`` / ``X_scales`` pair of a checkpoint replaced by ``X``; a lone half
    is refused by name."""
    out = {k: v for k, v in state.items() if not k.endswith((BLOCKS, SCALES))}
    for name in (k for k in state if k.endswith(BLOCKS)):
        base = name[: -len(BLOCKS)]
        if base + SCALES not in state:
            raise ValueError(f"{name}: an MXFP4 tensor without {base + SCALES}")
        out[base] = dequantize(state[name], state[base + SCALES], dtype)
    lone = [k for k in state if k.endswith(SCALES) and k[: -len(SCALES)] + BLOCKS not in state]
    if lone:
        raise ValueError(f"{lone[0]}: MXFP4 scales without {lone[0][: -len(SCALES)] + BLOCKS}")
    return out
