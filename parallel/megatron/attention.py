"""SDPACoreAttention: Megatron's core_attention on torch's scaled_dot_product_attention."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nvfp4_dist.parallel.megatron.compat import log_unknown_kwargs


class SDPACoreAttention(torch.nn.Module):
    """Megatron core_attention on torch's scaled_dot_product_attention (flash / memory-efficient kernels).

    Megatron's local DotProductAttention materialises the [b, heads, s, s] scores; this one does not,
    which keeps attention from dominating memory without Transformer Engine. Causal self-attention
    (attn_mask_type causal) ignores attention_mask, like Transformer Engine's; other mask types use it
    (True = masked out). Grouped-query attention is supported; context parallelism, packed sequences
    and attention bias are not.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **future_kwargs):
        super().__init__()
        log_unknown_kwargs(type(self).__name__, future_kwargs)
        if config.context_parallel_size != 1:
            raise ValueError(f"SDPACoreAttention: context_parallel_size={config.context_parallel_size}; "
                             "allowed: 1")
        from megatron.core.transformer.enums import AttnMaskType
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: attention_bias and packed_seq_params are not supported; "
                             "allowed: None")
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        mask = None if (self.causal or attention_mask is None) else attention_mask.logical_not()
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and q.is_cuda:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=self.causal, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=self.causal, scale=self.softmax_scale)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
