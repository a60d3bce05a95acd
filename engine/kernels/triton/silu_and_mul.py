"""SiLU-and-multiply (the Llama MLP activation): [T, 2I] -> silu(gate) * up, [T, I], float32 math.

    grid (T, cdiv(I, BLOCK))    out[t, j] = gate * sigmoid(gate) * up,  gate = x[t, j], up = x[t, I + j]

`silu_and_mul_reference` is the same contract in plain torch; the tests hold the kernel to it, and it to the
engine's `silu_and_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1, f"gate_up: [T, 2I], rows contiguous; got {gate_up.shape}"
    num_tokens, width = gate_up.shape
    assert width % 2 == 0, f"gate_up's last dim must be even (gate | up), got {width}"
    assert gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {gate_up.dtype}"
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
    )
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
