"""LayerNorm / RMSNorm that run under sequence parallelism without Transformer Engine or apex.

Under sequence parallelism each tensor-parallel rank normalizes its own slice of the sequence
with a full (replicated) copy of the norm's parameters, so each rank's parameter gradient is a
partial sum over its tokens. Megatron-Core's gradient finalization all-reduces, across the TP
group, the gradients of parameters marked `sequence_parallel = True`; this module sets that mark.
(Megatron's own local norm, WrappedTorchNorm, refuses sequence parallelism outright.)
The norm itself is nvfp4_dist.fused.norm: FP32 in a fixed order, the same numbers as the norms that
nvfp4_dist.layernorm_linear fuses into the NVFP4 cast of their output.
"""
import logging

import torch

from nvfp4_dist.fused import norm, norm_output_dtype

logger = logging.getLogger("nvfp4_dist")

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class SequenceParallelNorm(torch.nn.Module):
    """LayerNorm or RMSNorm over the last dim, with parameters marked for SP gradient reduction.

    normalization: "LayerNorm" (weight and bias) or "RMSNorm" (weight only).
    zero_centered_gamma: the weight is stored as (gamma - 1), initialised to zero (Megatron's
        layernorm_zero_centered_gamma).
    sequence_parallel: sets `param.sequence_parallel` on every parameter; Megatron-Core then
        all-reduces their gradients across the TP group.
    The parameter names (weight, bias) match torch.nn.LayerNorm / torch.nn.RMSNorm, so state dicts
    load into and from Megatron's local norm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, normalization: str = "LayerNorm",
                 sequence_parallel: bool = False, zero_centered_gamma: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={normalization!r}: allowed values are {NORMALIZATIONS}")
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size={hidden_size!r}: must be a positive integer")
        self.hidden_size = hidden_size
        self.eps = eps
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        if normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # Under autocast the norm computes in FP32; hand the next layer the autocast dtype, as the
        # matmuls that follow produce it (Megatron's SP output layer needs input and gradient to agree).
        return norm(x, weight.to(x.dtype), bias, normalization=self.normalization, eps=self.eps,
                    out_dtype=norm_output_dtype(x))

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, normalization={self.normalization}, "
                f"sequence_parallel={self.sequence_parallel}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")
