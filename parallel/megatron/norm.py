"""NVFP4Norm: Megatron's norm-builder signature over SequenceParallelNorm (parallel/norm.py)."""
from __future__ import annotations

from typing import Optional

from nvfp4_dist.parallel.megatron.compat import layer_device, log_unknown_kwargs
from nvfp4_dist.parallel.norm import SequenceParallelNorm


class NVFP4Norm(SequenceParallelNorm):
    """Megatron's norm-builder signature (config, hidden_size, eps) over SequenceParallelNorm.

    Follows config.normalization (LayerNorm | RMSNorm), config.layernorm_zero_centered_gamma,
    config.sequence_parallel and config.params_dtype; the device follows use_cpu_initialization.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: Optional[str] = None, **future_kwargs):
        log_unknown_kwargs(type(self).__name__, future_kwargs)
        super().__init__(
            hidden_size, eps, normalization=config.normalization,
            sequence_parallel=bool(config.sequence_parallel),
            zero_centered_gamma=bool(config.layernorm_zero_centered_gamma or zero_centered_gamma),
            params_dtype=config.params_dtype, device=layer_device(config))
