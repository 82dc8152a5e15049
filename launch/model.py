"""The small GPT of nvfp4-train's CPU path: NVFP4 tensor-parallel linears, everything else in BF16/FP32.

Per transformer layer: norm -> QKV (column-parallel) -> causal attention on this rank's heads ->
output projection (row-parallel) -> residual; norm -> fc1 (column-parallel) -> GELU -> fc2
(row-parallel) -> residual. Embeddings, norms, attention math and the output head stay in the
compute dtype and are replicated across the tensor-parallel group. Activations are [s, b, h];
with sequence parallelism the residual stream holds this rank's [s/tp, b, h] slice and the
parameters used on it carry `sequence_parallel = True` (their gradients are partial sums that
`reduce_sequence_parallel_grads` adds up across the group).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nvfp4_dist.launch.sharding import local_tensor
from nvfp4_dist.linear import name_layers
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from nvfp4_dist.parallel.norm import SequenceParallelNorm
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: int = 256
    seq_length: int = 64
    vocab_size: int = 256


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class ScatterSequence(torch.autograd.Function):
    """Keep this rank's slice of dim 0 (the sequence); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, rank = group_size(group), group_rank(group)
        return x.chunk(size, dim=0)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_dim0(grad.contiguous(), ctx.group), None


class GatherSequence(torch.autograd.Function):
    """All-gather dim 0 (the sequence) from every rank; backward keeps this rank's slice of the gradient.

    The slice (not a sum) is right because every rank computes the same replicated loss on the gathered tensor.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_dim0(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        size, rank = group_size(ctx.group), group_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank].contiguous(), None


def gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


class TransformerLayer(torch.nn.Module):
    def __init__(self, config: GPTConfig, *, tp_group, sequence_parallel: bool, recipe: NVFP4Recipe | RecipeMap,
                 bf16_fallback: bool, init_method, output_init_method, device):
        super().__init__()
        tp = group_size(tp_group)
        self.local_heads = config.num_heads // tp
        self.head_dim = config.hidden_size // config.num_heads
        common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, recipe=recipe,
                      bf16_fallback=bf16_fallback, device=device)
        norm = dict(normalization="LayerNorm", sequence_parallel=sequence_parallel, device=device)
        self.attention_norm = SequenceParallelNorm(config.hidden_size, **norm)
        # QKV output features are laid out per head ([q | k | v] of head 0, head 1, ...), so a
        # contiguous column-parallel shard holds whole heads.
        self.qkv = ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size, init_method=init_method,
                                        gather_output=False, **common)
        self.projection = RowParallelLinear(config.hidden_size, config.hidden_size, input_is_parallel=True,
                                            init_method=output_init_method, **common)
        self.mlp_norm = SequenceParallelNorm(config.hidden_size, **norm)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, init_method=init_method,
                                        gather_output=False, **common)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
                                     init_method=output_init_method, **common)

    def attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal self-attention on this rank's heads: [s, b, heads*3*d] -> [s, b, heads*d]."""
        seq, batch = qkv.shape[:2]
        q, k, v = qkv.view(seq, batch, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.local_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(self.attention_norm(x))
        projected, _ = self.projection(self.attention(qkv))
        x = x + projected
        hidden, _ = self.fc1(self.mlp_norm(x))
        out, _ = self.fc2(F.gelu(hidden))
        return x + out


class TinyGPT(torch.nn.Module):
    """A GPT whose four linears per layer are NVFP4 tensor-parallel; forward(tokens, labels) -> mean loss.

    recipe: the layers' recipe (its bf16_first_layers / bf16_last_layers build those layers in BF16).
    recipe_map: per-layer recipes (nvfp4_dist/recipe_map.py) by glob over the linears' module names,
    "layers.<n>.qkv", "layers.<n>.projection", "layers.<n>.fc1" and "layers.<n>.fc2", with `recipe` as its base.
    """

    def __init__(self, config: GPTConfig, *, tp_group=None, sequence_parallel: bool = False,
                 recipe: NVFP4Recipe | None = None, recipe_map: RecipeMap | None = None,
                 compute_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        recipe = recipe or NVFP4Recipe()
        layer_recipe = recipe if recipe_map is None else recipe_map.with_base(recipe)
        tp = group_size(tp_group)
        for name, value, divisor in (("num_heads", config.num_heads, tp), ("hidden_size", config.hidden_size,
                                                                          config.num_heads)):
            if value % divisor:
                raise ValueError(f"{name}={value} must be divisible by {divisor}")
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        self.compute_dtype = compute_dtype
        std = 0.02
        init_method = lambda weight: torch.nn.init.normal_(weight, 0.0, std)  # noqa: E731
        output_std = std / math.sqrt(2.0 * config.num_layers)
        output_init_method = lambda weight: torch.nn.init.normal_(weight, 0.0, output_std)  # noqa: E731
        self.token_embedding = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.position_embedding = torch.nn.Embedding(config.seq_length, config.hidden_size, device=device)
        for embedding in (self.token_embedding, self.position_embedding):
            init_method(embedding.weight.data)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, tp_group=tp_group, sequence_parallel=sequence_parallel, recipe=layer_recipe,
                             bf16_fallback=recipe.is_bf16_layer(index, config.num_layers),
                             init_method=init_method, output_init_method=output_init_method, device=device)
            for index in range(config.num_layers))
        self.final_norm = SequenceParallelNorm(config.hidden_size, normalization="LayerNorm",
                                               sequence_parallel=sequence_parallel, device=device)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        init_method(self.head.weight.data)
        name_layers(self)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels [b, s] int64 -> the mean next-token cross-entropy (FP32)."""
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        x = (self.token_embedding(tokens) + self.position_embedding(positions)).transpose(0, 1)  # [s, b, h]
        x = x.to(self.compute_dtype)
        if self.sequence_parallel:
            x = ScatterSequence.apply(x, self.tp_group)
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        if self.sequence_parallel:
            x = GatherSequence.apply(x, self.tp_group)
        logits = F.linear(x, self.head.weight.to(x.dtype)).float()  # [s, b, vocab]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.transpose(0, 1).reshape(-1))


def reduce_sequence_parallel_grads(model: torch.nn.Module, tp_group) -> None:
    """Sum, across the TP group, the gradients of parameters marked sequence_parallel (partial per rank); under
    --fsdp each rank's shards (the ranks of a TP group hold the same rows of each)."""
    grads = [local_tensor(p.grad) for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
