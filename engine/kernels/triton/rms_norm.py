"""Fused RMSNorm, with the residual add before it when given: one program per token row.

    residual_out = x + residual                       (rounded to the input dtype, as torch's add_ rounds it)
    out = weight * (r * rsqrt(mean(r^2) + eps))       r = residual_out in float32; the normalised row is
                                                      rounded to the input dtype before the weight multiplies
                                                      it (HF LlamaRMSNorm's order, `engine.model.llama.rms_norm`)

`rms_norm_reference` is the same contract in plain torch; the tests hold the kernel to it, and it to the
engine's `rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] or x_ptr (unused)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N] or out_ptr (unused)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N], x's dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (normed [T, N], the new residual [T, N]): x + residual, a new tensor; x itself when no residual."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x: [T, N] with contiguous rows, got {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight: [{hidden}], got {tuple(weight.shape)}"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {x.dtype}"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x {x.dtype}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1, (
            f"residual: {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0),
        hidden,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual if residual is not None else x
    xf = new_residual.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), new_residual
