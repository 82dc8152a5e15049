"""MoE token dispatch in NVFP4 (recipe.moe_dispatch = "nvfp4", docs/numerics.md §13).

Before the expert-parallel all-to-all each token is quantized once, rowwise, with its own amax (the row-scaled
scheme of docs/numerics.md §6): its codes do not depend on which rank or expert receives it, and no amax
all-reduce is needed first. A token travels as one row of bytes: H/2 packed codes, H/16 E4M3 scales and its FP32
amax (0.5625 + 4/H bytes per element instead of 2 for BF16). The receiver gets the NVFP4 rowwise copy of its tokens
(which feeds the experts' fc1 GEMM as it is) and their dequantized values (the input that autograd sees, and from
which fc1 makes its wgrad copy). Backward sends the gradient of the dequantized tokens back in its own dtype (the
reverse all-to-all): the quantization is the identity for the gradient, as every NVFP4 cast is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nvfp4_dist import ops
from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor

AMAX_BYTES = 4  # one FP32 amax per token


def dispatch_recipe(recipe: NVFP4Recipe) -> NVFP4Recipe:
    """The recipe dispatched tokens are quantized with: `recipe` with one amax per token (row-scaled)."""
    return recipe.replace(row_scaled_activation=True)


def row_bytes(hidden: int) -> int:
    """Bytes one token of `hidden` elements takes in NVFP4 dispatch: codes, block scales, amax."""
    return hidden // 2 + hidden // BLOCK_SIZE + AMAX_BYTES


def quantize_tokens(tokens: torch.Tensor, recipe: NVFP4Recipe) -> NVFP4Tensor:
    """The NVFP4 rowwise copy of tokens [T, H], one amax per token (what dispatch sends)."""
    return ops.quantize(tokens, "activation", rowwise=True, columnwise=False, recipe=dispatch_recipe(recipe),
                        check_finite=recipe.check_finite)


def pack_rows(q: NVFP4Tensor) -> torch.Tensor:
    """uint8 [T, row_bytes(H)]: each token's codes, scales and amax side by side (one all-to-all moves them)."""
    amax = q.amax_rowwise.reshape(-1, 1).contiguous().view(torch.uint8)
    return torch.cat([q.rowwise_data, q.rowwise_scale.view(torch.uint8), amax], dim=1)


def unpack_rows(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> NVFP4Tensor:
    """The inverse of pack_rows: a row-scaled NVFP4Tensor [T, hidden] (rowwise copy) of dtype `dtype`."""
    codes, scales = hidden // 2, hidden // BLOCK_SIZE
    data = packed[:, :codes].contiguous()
    scale = packed[:, codes:codes + scales].contiguous().view(SCALE_DTYPE)
    amax = packed[:, codes + scales:].contiguous().view(torch.float32).reshape(-1)
    return NVFP4Tensor(shape=torch.Size((packed.shape[0], hidden)), dtype=dtype, rowwise_data=data,
                       rowwise_scale=scale, amax_rowwise=amax, row_scaled=True)


def _splits(splits, rows: int, world: int) -> list[int]:
    """All-to-all split sizes as a list of ints (None: equal parts)."""
    if splits is None:
        return [rows // world] * world
    return [int(size) for size in (splits.tolist() if hasattr(splits, "tolist") else splits)]


def all_to_all_rows(rows: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    """All-to-all of rows over `group`: input_splits[r] rows go to rank r, output_splits[r] come from it; the
    input itself where the group has one rank."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return rows
    sent = _splits(input_splits, rows.shape[0], world)
    received = _splits(output_splits, sum(sent), world)
    out = rows.new_empty((sum(received), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
    return out


class NVFP4DispatchFunction(torch.autograd.Function):
    """tokens -> their dequantized NVFP4 values on the receiving ranks (received copy appended to `holder`)."""

    @staticmethod
    def forward(ctx, tokens, recipe, group, output_splits, input_splits, holder: list):
        packed = all_to_all_rows(pack_rows(quantize_tokens(tokens, recipe)), output_splits, input_splits, group)
        received = unpack_rows(packed, tokens.shape[-1], tokens.dtype)
        holder.append(received)
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return ops.dequantize(received, dtype=tokens.dtype)

    @staticmethod
    def backward(ctx, grad):
        back = all_to_all_rows(grad, ctx.input_splits, ctx.output_splits, ctx.group)
        return back, None, None, None, None, None


def dispatch_nvfp4(tokens: torch.Tensor, recipe: NVFP4Recipe, group, output_splits=None, input_splits=None):
    """(dequantized received tokens [T_recv, H] with autograd back to `tokens`, their NVFP4Tensor rowwise copy).

    tokens [T, H] are already ordered by destination rank (input_splits[r] rows for rank r; output_splits[r] rows
    arrive from rank r; None: equal parts)."""
    if tokens.dim() != 2 or tokens.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"tokens.shape={tuple(tokens.shape)}: expected [tokens, hidden] with hidden a multiple of "
                         f"{BLOCK_SIZE}")
    holder: list = []
    values = NVFP4DispatchFunction.apply(tokens, recipe, group, output_splits, input_splits, holder)
    return values, holder[0]


def dispatch_bytes(tokens: int, hidden: int, mode: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes that dispatching `tokens` tokens of `hidden` elements moves: NVFP4 rows, or the tokens in `dtype`."""
    if mode == "nvfp4":
        return tokens * row_bytes(hidden)
    if mode == "bf16":
        return tokens * hidden * torch.tensor([], dtype=dtype).element_size()
    raise ValueError(f"mode={mode!r} is not one of ('bf16', 'nvfp4')")
