"""nvfp4-train's GPU model: Megatron-Core's GPTModel with the NVFP4 decoder-block spec.

The first/last --bf16-first-layers/--bf16-last-layers transformer layers stay in BF16; --recipe-config's
per-layer recipes reach the linears through the spec's recipe_map; the norms and the activation sit inside the
linears after them (the spec's fused_producers, Plan.fused_producers) unless --no-fused-producers. Parameters
are FP32 (master weights); with --dtype bf16 the forward runs under torch.autocast. On CPU (tests,
--model megatron --device cpu) attention is torch's SDPA, since Megatron's DotProductAttention
allocates its causal mask on CUDA, and Megatron's RNG tracker is the no-op one (dropout is off).
Megatron-Core is imported here only.
"""
from __future__ import annotations

import torch


class MegatronGPTLoss(torch.nn.Module):
    """forward(tokens, labels) -> mean loss, around a GPTModel (the interface of launch.model.TinyGPT)."""

    def __init__(self, gpt, seq_length: int, autocast_dtype):
        super().__init__()
        self.gpt = gpt
        self.autocast_dtype = autocast_dtype
        self.register_buffer("causal_mask", torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            losses = self.gpt(tokens, positions, self.causal_mask.to(tokens.device), labels=labels)
        return losses.float().mean()


def build_megatron_gpt(plan, device):
    """(model, tp_group, dp_group): GPTModel with the NVFP4 spec for this rank, Megatron's groups initialised."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nvfp4_dist.parallel import megatron as nvfp4_megatron

    args = plan.args
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=plan.tp)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    else:  # no CUDA RNG to fork; dropout is off, so Megatron's tracker may be the no-op one
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=plan.ffn, tensor_model_parallel_size=plan.tp, sequence_parallel=args.sp,
        params_dtype=torch.float32, use_cpu_initialization=device.type == "cpu", perform_initialization=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, init_method_std=0.02)
    spec = nvfp4_megatron.get_gpt_decoder_block_nvfp4_spec(
        config, recipe=plan.recipe, recipe_map=plan.recipe_map, bf16_first_layers=args.bf16_first_layers,
        bf16_last_layers=args.bf16_last_layers, fused_producers=plan.fused_producers)
    if device.type == "cpu":
        spec = nvfp4_megatron.with_sdpa_attention(spec)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256,
                   max_sequence_length=args.seq_length, share_embeddings_and_output_weights=True)
    gpt.to(device)
    autocast_dtype = torch.bfloat16 if plan.dtype == "bf16" else None
    model = MegatronGPTLoss(gpt, args.seq_length, autocast_dtype).to(device)
    return (model, parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_data_parallel_group())
