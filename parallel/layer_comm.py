"""The communication of the NVFP4 linear Function for each tensor-parallel layer kind (docs/numerics.md §9).

ColumnParallelComm and RowParallelComm are the plain (not pipelined) paths; parallel/overlap.py
derives the ring-pipelined twins from them, and parallel/layers.py picks one per forward. The unquantized backward
modes (recipe.backward_mode, docs/numerics.md §10) gather and reduce tensors in the compute dtype: a
sequence-parallel column-parallel layer all-gathers its input for wgrad (high_precision; its NVFP4 rowwise copy,
dequantized after the gather, in the dequantized mode), a row-parallel one its output gradient.
Their NaN/Inf checks run across the group (parallel/group_checks.py): an operand that differs between ranks
(a weight shard, a row-parallel input, a column-parallel output gradient) is exchanged in one small MAX
all-reduce; one whose amaxes were already reduced (sequence-parallel gathers) or that every rank holds whole
(a row-parallel output gradient) needs no exchange.
"""
from __future__ import annotations

from nvfp4_dist import hot_path
from nvfp4_dist.linear import LinearComm, operand_amaxes, quantize_operand
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel.group_checks import check_finite_across_group


def _check_finite(operands: dict, layer_name: str, group, agreed: set) -> None:
    """check_finite_across_group of {role: NVFP4Tensor}; roles in `agreed` are equal on every rank."""
    labels = {f"the {role} of {layer_name}": q for role, q in operands.items()}
    check_finite_across_group(labels, group, reduced=frozenset(f"the {role} of {layer_name}" for role in agreed))


class ColumnParallelComm(LinearComm):
    """Input gathered (SP) before fprop; dgrad partial sums reduced after."""

    def __init__(self, group, sequence_parallel: bool, keep_input_columnwise: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.keep_input_columnwise = keep_input_columnwise
        self.world_size = collectives.group_size(group)

    def output_shape(self, input_shape, out_features):
        if not self.sequence_parallel:
            return super().output_shape(input_shape, out_features)
        return (input_shape[0] * self.world_size, *input_shape[1:-1], out_features)

    def quantize_input(self, x2d, recipe, *, columnwise):
        if not self.sequence_parallel:
            return super().quantize_input(x2d, recipe, columnwise=columnwise)
        amax_rowwise, amax_columnwise = operand_amaxes(x2d, "activation", recipe, rowwise=True, columnwise=columnwise)
        # Row-scaled (docs/numerics.md §6, 6b): the per-row amaxes travel with their rows; the per-column amaxes
        # of the columnwise copy, a K-vector, are reduced over the group like a per-tensor amax.
        collectives.all_reduce_amax([None if recipe.row_scaled_activation else amax_rowwise, amax_columnwise],
                                    self.group)
        return quantize_operand(x2d, "activation", recipe, rowwise=True, columnwise=columnwise,
                                amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise)

    def check_finite(self, operands, layer_name):
        source = operands.get("input")
        reduced = self.sequence_parallel and source is not None and not source.row_scaled
        _check_finite(operands, layer_name, self.group, {"input"} if reduced else set())

    def fprop(self, xq, wq, *, bias, out_dtype, recipe):
        if self.sequence_parallel:
            xq = collectives.all_gather_nvfp4(xq, self.group)
        return hot_path.gemm(xq, wq, a_copy="rowwise", b_copy="rowwise", out_dtype=out_dtype, bias=bias,
                             recipe=recipe)

    def input_to_save(self, xq):
        if self.sequence_parallel and self.keep_input_columnwise:
            return collectives.all_gather_nvfp4(xq, self.group)
        return xq

    def input_for_wgrad(self, saved_input):
        if not self.sequence_parallel or self.keep_input_columnwise:
            return lambda: saved_input
        return collectives.all_gather_nvfp4(saved_input, self.group, async_op=True)[1]

    def reduce_partial(self, partial):
        if self.sequence_parallel:
            return collectives.reduce_scatter_bf16(partial, self.group)
        return collectives.all_reduce_bf16(partial, self.group)

    def dgrad(self, dyq, wq, *, out_dtype, recipe):
        return self.reduce_partial(super().dgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe))

    def unquantized_dgrad(self, dy2d, weight):
        return self.reduce_partial(dy2d @ weight)

    def unquantized_input_to_save(self, x2d):
        if self.sequence_parallel and self.keep_input_columnwise:
            return collectives.all_gather_bf16(x2d, self.group)
        return x2d

    def unquantized_input_for_wgrad(self, saved_input):
        if not self.sequence_parallel or self.keep_input_columnwise:
            return lambda: saved_input
        return collectives.all_gather_bf16(saved_input, self.group, async_op=True)[1]


class RowParallelComm(LinearComm):
    """fprop partial sums reduced after; the output gradient gathered (SP) before dgrad and wgrad."""

    def __init__(self, group, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.world_size, self.rank = collectives.group_size(group), collectives.group_rank(group)

    def output_shape(self, input_shape, out_features):
        if not self.sequence_parallel:
            return super().output_shape(input_shape, out_features)
        return (input_shape[0] // self.world_size, *input_shape[1:-1], out_features)

    def check_finite(self, operands, layer_name):
        _check_finite(operands, layer_name, self.group, {"gradient"})

    def fprop(self, xq, wq, *, bias, out_dtype, recipe):
        partial = hot_path.gemm(xq, wq, a_copy="rowwise", b_copy="rowwise", out_dtype=out_dtype, bias=bias,
                                recipe=recipe)
        if self.sequence_parallel:
            return collectives.reduce_scatter_bf16(partial, self.group)
        return collectives.all_reduce_bf16(partial, self.group)

    def quantize_grad_output(self, dy2d, recipe, *, sr_seed, rowwise, columnwise):
        if not self.sequence_parallel:
            return super().quantize_grad_output(dy2d, recipe, sr_seed=sr_seed, rowwise=rowwise, columnwise=columnwise)
        amaxes = list(operand_amaxes(dy2d, "gradient", recipe, rowwise=rowwise, columnwise=columnwise))
        collectives.all_reduce_amax(amaxes, self.group)
        return quantize_operand(dy2d, "gradient", recipe, rowwise=rowwise, columnwise=columnwise,
                                amax_rowwise=amaxes[0], amax_columnwise=amaxes[1], sr_seed=sr_seed,
                                sr_row_offset=self.rank * dy2d.shape[0])

    def grad_output_for_wgrad(self, dyq):
        if not self.sequence_parallel:
            return lambda: dyq
        return collectives.all_gather_nvfp4(dyq, self.group, async_op=True)[1]

    def dgrad(self, dyq, wq, *, out_dtype, recipe):
        if self.sequence_parallel:
            dyq = collectives.all_gather_nvfp4(dyq, self.group)
        return super().dgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe)

    def unquantized_grad_output(self, dy2d):
        return collectives.all_gather_bf16(dy2d, self.group) if self.sequence_parallel else dy2d
