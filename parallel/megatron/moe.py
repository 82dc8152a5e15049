"""NVFP4GroupedMLP: Megatron-Core's MoE experts (in the place of SequentialMLP / TEGroupedMLP) on nv.GroupedLinear.

Megatron's MoELayer routes (its TopKRouter, in the model's precision), dispatches (its alltoall or allgather
token dispatcher, unchanged), calls experts(permuted_tokens, tokens_per_expert, permuted_probs), and combines.
This module is the experts: linear_fc1 and linear_fc2 are GroupedLinear layers holding this rank's experts
(weight<i>, bias<i> as in TEGroupedMLP), and between them the activation (SwiGLU with gated_linear_unit, else
config.activation_func) times each token's routing probability, as TEGroupedMLP computes it (the activation is
not fused into fc2's input cast here). The fc2 bias of expert e is added as b_e * p (TEGroupedMLP's rule).

Each expert's tokens are padded with zero rows to a multiple of 16 before fc1 (the wgrad copies are blocked along
tokens; Transformer Engine pads the same way) and the padding is dropped after fc2; zero rows change no amax and add
nothing to the weight gradients.

Parallelism: the experts' weights are initialised from each global expert's full weights, in expert order (fc1
then fc2 per expert, use_cpu_initialization semantics), and each rank keeps its experts and, with expert tensor
parallelism, its shard (fc1 by output rows, strided [gate | up] under GLU; fc2 by input columns): the model is the
same at every EP and ETP size. Parameters carry Megatron's attributes: allreduce=False when expert parallelism or
an expert TP size that differs from TP puts them in the expert data-parallel group (Megatron's rule, as for
SequentialMLP), tensor_model_parallel / partition_dim / partition_stride for the ETP shards. The dispatcher does
the expert-TP communication (gather before, reduce-scatter after), so the layers communicate nothing.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.grouped_linear import GroupedLinear
from nvfp4_dist.parallel.moe_dispatch import dispatch_nvfp4, pack_rows, unpack_rows
from nvfp4_dist.parallel.megatron.adapters import _strided_order, _uses_expert_groups
from nvfp4_dist.parallel.megatron.compat import layer_device, log_unknown_kwargs
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap
from nvfp4_dist.tensor import NVFP4Tensor


def padded_sizes(sizes: list[int]) -> list[int]:
    """Each expert's token count rounded up to a multiple of 16."""
    return [-(-size // BLOCK_SIZE) * BLOCK_SIZE for size in sizes]


def pad_rows(x: torch.Tensor, sizes: list[int], padded: list[int]) -> torch.Tensor:
    """x's expert row blocks, each followed by zero rows up to its padded size."""
    if sizes == padded:
        return x
    pieces = []
    for piece, size, target in zip(torch.split(x, sizes), sizes, padded):
        pieces.append(piece)
        if target > size:
            pieces.append(x.new_zeros((target - size, *x.shape[1:])))
    return torch.cat(pieces)


def pad_quantized_rows(q: NVFP4Tensor, sizes: list[int], padded: list[int]) -> NVFP4Tensor:
    """pad_rows of a row-scaled rowwise copy: zero codes, scales and amaxes (the copy of zero rows)."""
    if sizes == padded:
        return q
    return unpack_rows(pad_rows(pack_rows(q), sizes, padded), q.cols, q.dtype)


def unpad_rows(x: torch.Tensor, sizes: list[int], padded: list[int]) -> torch.Tensor:
    """The inverse of pad_rows: each expert's first sizes[e] rows."""
    if sizes == padded:
        return x
    return torch.cat([piece[:size] for piece, size in zip(torch.split(x, padded), sizes)])


class NVFP4GroupedMLP(MegatronModule):
    """Megatron's experts module (constructor and forward of SequentialMLP / TEGroupedMLP) on GroupedLinear.

    forward(permuted_local_hidden_states [tokens, hidden], tokens_per_expert [E_local], permuted_probs [tokens])
    -> (output [tokens, hidden], None). Extra keywords: recipe (NVFP4Recipe, RecipeMap, or None: autocast /
    environment), bf16_fallback (both layers unquantized), layer_name (the module name; the layers are named
    "<layer_name>.linear_fc1" / ".linear_fc2"), grouped_gemm (GroupedLinear's).
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, *,
                 recipe: Optional[Union[NVFP4Recipe, RecipeMap]] = None, bf16_fallback: bool = False,
                 layer_name: Optional[str] = None, grouped_gemm: bool = True, **future_kwargs):
        super().__init__(config=config)
        log_unknown_kwargs(type(self).__name__, future_kwargs)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        self.layer_name = layer_name
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        ffn = config.moe_ffn_hidden_size
        glu = bool(config.gated_linear_unit)
        for name, value in (("moe_ffn_hidden_size", ffn), ("hidden_size", config.hidden_size)):
            if value % tp_size:
                raise ValueError(f"config.{name}={value} is not divisible by the expert tensor-parallel size {tp_size}")
        if getattr(config, "moe_latent_size", None):
            raise ValueError(f"config.moe_latent_size={config.moe_latent_size}: latent MoE projections are not "
                             "supported by NVFP4GroupedMLP; allowed: None")
        fc1_out, fc2_in = (2 * ffn if glu else ffn) // tp_size, ffn // tp_size
        # Built on the meta device (their own initialisation draws nothing), then given storage and initialised
        # here, from Megatron's init methods.
        common = dict(bias=config.add_bias_linear, device="meta", dtype=config.params_dtype,
                      recipe=recipe, bf16_fallback=bf16_fallback, grouped_gemm=grouped_gemm,
                      accumulate_into_main_grad=bool(config.gradient_accumulation_fusion),
                      delay_wgrad=bool(getattr(config, "delay_wgrad_compute", False)))
        self.linear_fc1 = GroupedLinear(num_local_experts, config.hidden_size, fc1_out, **common)
        self.linear_fc2 = GroupedLinear(num_local_experts, fc2_in, config.hidden_size, skip_bias_add=True, **common)
        for linear, suffix in ((self.linear_fc1, "linear_fc1"), (self.linear_fc2, "linear_fc2")):
            linear.to_empty(device=layer_device(config))
            linear.layer_name = f"{layer_name}.{suffix}" if layer_name else None
        self._initialise(ep_rank * num_local_experts, ep_size * num_local_experts, tp_rank, tp_size, glu)
        reduce_over_dp = not _uses_expert_groups(config, True)
        for linear, dim, stride in ((self.linear_fc1, 0, 2 if glu else 1), (self.linear_fc2, 1, 1)):
            for weight in linear.weights():
                weight.allreduce = reduce_over_dp
                weight.tensor_model_parallel = tp_size > 1
                weight.partition_dim, weight.partition_stride = dim, stride
            for bias in linear.biases():
                if bias is not None:
                    bias.allreduce = reduce_over_dp
                    bias.tensor_model_parallel = dim == 0 and tp_size > 1
                    bias.partition_dim, bias.partition_stride = 0, stride
        if glu:
            self.activation = lambda h: (lambda gate, up: self.config.activation_func(gate) * up)(*h.chunk(2, dim=-1))
        else:
            self.activation = self.config.activation_func

    @torch.no_grad()
    def _initialise(self, first_expert: int, num_experts: int, tp_rank: int, tp_size: int, glu: bool) -> None:
        """Every global expert's full fc1 and fc2 weights drawn in expert order (fc1, fc2), this rank's kept."""
        config = self.config
        if not config.perform_initialization:
            return
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        device = layer_device(config)  # drawn where the weights live, as the adapters draw their full weights
        for expert in range(num_experts):
            fc1 = torch.empty(2 * ffn if glu else ffn, hidden, dtype=torch.float32, device=device)
            config.init_method(fc1)
            fc2 = torch.empty(hidden, ffn, dtype=torch.float32, device=device)
            config.output_layer_init_method(fc2)
            local = expert - first_expert
            if not 0 <= local < self.num_local_experts:
                continue
            if glu and tp_size > 1:
                fc1 = _strided_order(fc1, 0, 2, tp_size)
            fc1_shard = fc1.chunk(tp_size, dim=0)[tp_rank]
            fc2_shard = fc2.chunk(tp_size, dim=1)[tp_rank]
            self.linear_fc1.weights()[local].copy_(fc1_shard)
            self.linear_fc2.weights()[local].copy_(fc2_shard)
        for linear in (self.linear_fc1, self.linear_fc2):
            for bias in linear.biases():
                if bias is not None:
                    bias.zero_()

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, nvfp4_input: Optional[NVFP4Tensor] = None):
        """nvfp4_input: the tokens' NVFP4 rowwise copy from an NVFP4 dispatch (NVFP4MoELayer), which fc1's fprop
        takes as it is; permuted_local_hidden_states then holds its dequantized values."""
        hidden = permuted_local_hidden_states
        probs = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("config.moe_apply_probs_on_input=True needs moe_router_topk=1")
            hidden = (probs * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        sizes = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
        padded = padded_sizes(sizes)
        hidden = pad_rows(hidden, sizes, padded)
        probs = pad_rows(probs, sizes, padded)
        if nvfp4_input is not None:
            if self.config.moe_apply_probs_on_input:
                raise ValueError("config.moe_apply_probs_on_input=True with NVFP4 dispatch: the dispatched codes are "
                                 "of the tokens before the probabilities; use recipe moe_dispatch='bf16'")
            nvfp4_input = pad_quantized_rows(nvfp4_input, sizes, padded)
        intermediate = self.linear_fc1(hidden, padded, rowwise_input=nvfp4_input)
        activated = (self.activation(intermediate) * probs).to(intermediate.dtype)
        output, biases = self.linear_fc2(activated, padded)
        if self.config.add_bias_linear:
            rows = torch.cat([bias.expand(size, -1) for bias, size in zip(biases, padded)])
            output = (output + rows * probs).to(output.dtype)
        return unpad_rows(output, sizes, padded), None

    def backward_dw(self) -> None:
        """Run the deferred wgrad GEMMs (config.delay_wgrad_compute), fc2's first."""
        self.linear_fc2.backward_dw()
        self.linear_fc1.backward_dw()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> ShardedStateDict:
        """SequentialMLP's distributed-checkpoint layout: each expert as "<prefix>experts.linear_fc1.weight" (and
        fc2, biases) with the global expert index as a leading sharded axis, TP shards as its MLP's (GLU fc1 split
        in gate and up), replicated over the expert data-parallel group."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if (metadata or {}).get("singleton_local_shards", False):
            raise ValueError("metadata singleton_local_shards=True is not supported by NVFP4GroupedMLP; allowed: "
                             "False (the default)")
        sharded = {}
        num_global = self.ep_group.size() * self.num_local_experts
        first = self.ep_group.rank() * self.num_local_experts
        tp_axis = {"linear_fc1.weight": 0, "linear_fc1.bias": 0, "linear_fc2.weight": 1}
        for local in range(self.num_local_experts):
            state, state_keys = {}, {}
            for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2)):
                for kind, values in (("weight", linear.weights()), ("bias", linear.biases())):
                    if values[local] is not None:
                        state[f"{name}.{kind}"] = values[local]
                        state_keys[f"{prefix}experts.{name}.{kind}"] = f"{prefix}{name}.{kind}{local}"
            offsets = (*sharded_offsets, (len(sharded_offsets), first + local, num_global))
            expert = make_sharded_tensors_for_checkpoint(state, f"{prefix}experts.", tp_axis, offsets,
                                                         tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
            for key, value in expert.items():
                if self.config.gated_linear_unit and key.startswith(f"{prefix}experts.linear_fc1."):
                    value = apply_swiglu_sharded_factory(value, offsets)
                value.replica_id = (*value.replica_id[:2], self.dp_group.rank())
                sharded[state_keys[key]] = value
        return sharded


class NVFP4MoELayer(MoELayer):
    """Megatron's MoELayer whose alltoall dispatch sends NVFP4 tokens where the experts' recipe says
    moe_dispatch="nvfp4" (parallel/moe_dispatch.py, docs/numerics.md §13): each token quantized once, rowwise with
    its own amax, before the expert-parallel all-to-all; the experts' fc1 takes the received codes as its input copy.
    The routing probabilities and the combine stay in their dtype. Otherwise (moe_dispatch "bf16", BF16 experts)
    it is Megatron's MoELayer. NVFP4 dispatch needs the alltoall dispatcher without expert tensor parallelism or
    capacity padding (ValueError otherwise)."""

    _dispatched: Optional[NVFP4Tensor] = None

    def _nvfp4_dispatch_recipe(self) -> Optional[NVFP4Recipe]:
        if not isinstance(self.experts, NVFP4GroupedMLP):
            return None
        recipe = self.experts.linear_fc1.resolved_recipe()
        if recipe is None or recipe.moe_dispatch != "nvfp4":
            return None
        dispatcher = self.token_dispatcher
        if type(dispatcher) is not MoEAlltoAllTokenDispatcher or dispatcher.tp_size > 1 or dispatcher.drop_and_pad:
            raise ValueError(f"recipe moe_dispatch='nvfp4' needs config.moe_token_dispatcher_type='alltoall' without "
                             f"expert tensor parallelism or capacity padding (got "
                             f"{self.config.moe_token_dispatcher_type!r}, expert TP {dispatcher.tp_size}); allowed "
                             f"otherwise: moe_dispatch='bf16'")
        return recipe

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        recipe = self._nvfp4_dispatch_recipe()
        self._dispatched = None
        if recipe is None:
            return super().dispatch(hidden_states, probs)
        dispatcher = self.token_dispatcher
        dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize("before_ep_alltoall",
                                                                              dispatcher.tokens_per_expert)
        values, self._dispatched = dispatch_nvfp4(hidden_states, recipe, dispatcher.ep_group,
                                                  dispatcher.output_splits, dispatcher.input_splits)
        global_probs = all_to_all(dispatcher.ep_group, probs, dispatcher.output_splits, dispatcher.input_splits)
        return values, global_probs

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self._dispatched is None:
            return super().routed_experts_compute(hidden_states, probs)
        dispatcher, received = self.token_dispatcher, self._dispatched
        self._dispatched = None
        dispatched_input, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
        if dispatcher.num_local_experts > 1:  # the same sort by local expert as the dispatcher's
            packed, _ = sort_chunks_by_idxs(pack_rows(received), dispatcher.num_global_tokens_per_local_expert.ravel(),
                                            dispatcher.sort_input_by_local_experts, fused=False)
            received = unpack_rows(packed, received.cols, received.dtype)
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs,
                                               nvfp4_input=received)
        return dispatcher.combine_preprocess(expert_output), mlp_bias
