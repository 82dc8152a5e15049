"""NVFP4MLP: Megatron's MLP with its activation fused into the cast of linear_fc2's input."""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from nvfp4_dist.parallel.megatron.adapters import NVFP4RowParallelLinear


def fused_activation_name(config) -> str | None:
    """The project's activation (nvfp4_dist.fused.activation) that is this config's MLP activation, or None.

    SwiGLU: activation_func F.silu with gated_linear_unit; GELU: F.gelu without it (and without
    bias_activation_fusion, whose GELU is the tanh approximation); no activation clamp or GLU offset. The
    project's activations compute in FP32 and round once, so they can differ from torch's by an ulp of the
    output dtype.
    """
    if getattr(config, "use_te_activation_func", False) or getattr(config, "activation_func_clamp_value", None):
        return None
    if getattr(config, "glu_linear_offset", 0.0):
        return None
    if config.activation_func is F.silu and config.gated_linear_unit:
        return "swiglu"
    if config.activation_func is F.gelu and not config.gated_linear_unit and not config.bias_activation_fusion:
        return "gelu"
    return None


class NVFP4MLP(MLP):
    """Megatron's MLP whose linear_fc2 (NVFP4RowParallelLinear) applies the activation to fc1's output itself,
    fused into its input's cast where recipe.fused_producers allows (the activation's output is not written).

    Configs whose activation has no counterpart here (fused_activation_name None), per-token scales and other
    linear_fc2 modules run Megatron's own forward.
    """

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        name = fused_activation_name(self.config)
        if name is None or per_token_scale is not None or not isinstance(self.linear_fc2, NVFP4RowParallelLinear):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(intermediate, activation=name)
