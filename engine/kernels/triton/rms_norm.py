"""Fused RMSNorm, with the residual add before it when given: one program per token row.

    residual_out = x + residual                       (rounded to the input dtype, as torch's add_ rounds it)
    out = weight * (r * rsqrt(mean(r^2) + eps))       r = residual_out in float32; the normalised row is
                                                      rounded to the input dtype before the weight multiplies
                                                      it (HF LlamaRMSNorm's order, `engine.model.llama.rms_norm`)

`rms_norm_reference` is the same contract in plain torch; the tests hold the kernel to it, and it to the
engine's `rms_norm`.

`embed_rms_norm` is the model's first step in the same launch: x = embed[input_ids] gathered by the kernel (no
residual), so the embedding lookup is no launch of its own; the residual it returns is that gathered copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N], or the embedding table [V, N] when GATHER
    ids_ptr,  # [T] row ids into x when GATHER, else x_ptr (unused)
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
    GATHER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if GATHER:
        source = tl.load(ids_ptr + row).to(tl.int64)
    else:
        source = row
    x = tl.load(x_ptr + source * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    if GATHER:
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
        GATHER=False,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual_out


def embed_rms_norm(
    input_ids: torch.Tensor,  # [T] int32/int64, each in [0, V)
    embed: torch.Tensor,  # [V, N]
    weight: torch.Tensor,  # [N], embed's dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(embed[input_ids]) [T, N], embed[input_ids] [T, N], the first residual): one launch, the same
    bits as `rms_norm(F.embedding(input_ids, embed), weight, eps)`."""
    assert input_ids.dim() == 1 and input_ids.dtype in (torch.int32, torch.int64), "input_ids: [T] int32/int64"
    assert embed.dim() == 2 and embed.stride(1) == 1, f"embed: [V, N] with contiguous rows, got {tuple(embed.shape)}"
    vocab, hidden = embed.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight: [{hidden}], got {tuple(weight.shape)}"
    assert embed.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {embed.dtype}"
    assert weight.dtype == embed.dtype, f"weight is {weight.dtype}, embed {embed.dtype}"
    num_tokens = input_ids.shape[0]
    out = torch.empty(num_tokens, hidden, dtype=embed.dtype, device=embed.device)
    residual_out = torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        embed,
        input_ids,
        embed,
        weight,
        out,
        residual_out,
        embed.stride(0),
        0,
        out.stride(0),
        residual_out.stride(0),
        hidden,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=False,
        GATHER=True,
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
