"""NVFP4 linear layer: the autograd Function shared by every layer, and the single-device nvfp4_dist.Linear.

The three GEMMs of y = x W^T run in NVFP4 (docs/numerics.md §3):
  fprop  y  = x . W^T   x rowwise (1D),  W rowwise (2D blocks by default)
  dgrad  dx = dy . W    dy rowwise (1D, stochastic rounding),  W columnwise
  wgrad  dW = dy^T . x  dy columnwise (RHT + SR),  x columnwise (RHT)
Backward keeps only the quantized copies it needs (x columnwise, W columnwise), not x itself; with
requantize_weight_in_backward it keeps no weight copy at all and quantizes W's columnwise copy again.
recipe.backward_mode (docs/numerics.md §10) runs dgrad and wgrad in the compute dtype instead, on the unquantized
output gradient and either x and W as given ("high_precision": forward saves x) or the rowwise copies fprop used,
dequantized ("dequantized": forward saves those copies).

Communication is a LinearComm object (this module's base class is TP=1: none); the tensor-parallel
layers of nvfp4_dist.parallel subclass it. With recipe.check_finite, the Function checks the amaxes of what it
quantizes (input and weight in forward, the output gradient in backward) through comm.check_finite, which the
tensor-parallel comms do across their group, so that a NaN on any rank stops every rank. Row-scaled activations
(docs/numerics.md §6) run all three GEMMs in NVFP4 too: x's columnwise copy carries one amax per column (§6b),
which scales wgrad's output columns; recipe.backward_mode "dequantized" gives them the BF16 backward on the
dequantized forward operands instead.

RHT with FP16/FP32 activations: the RHT path takes BF16 only, so the columnwise (wgrad) copy of such a
tensor is quantized from its BF16 cast; its rowwise copy is quantized from the tensor as given.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from nvfp4_dist import environment, finite_check, hot_path, ops
from nvfp4_dist.autocast import nvfp4_enabled, resolve_layer_recipe
from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap, check_layer_recipe
from nvfp4_dist.tensor import NVFP4Tensor

logger = logging.getLogger("nvfp4_dist")


def needs_bf16_columnwise_source(role: str, recipe: NVFP4Recipe, dtype: torch.dtype) -> bool:
    """True when the columnwise copy gets the RHT but the tensor is not BF16 (cast it first)."""
    return role != "weight" and recipe.rht and dtype != torch.bfloat16


def operand_amaxes(x2d: torch.Tensor, role: str, recipe: NVFP4Recipe, *, rowwise: bool = True,
                   columnwise: bool = True):
    """(amax_rowwise, amax_columnwise) that quantize_operand would use (None for copies not asked)."""
    if columnwise and needs_bf16_columnwise_source(role, recipe, x2d.dtype):
        amax_rowwise = None
        if rowwise:
            amax_rowwise = ops.compute_amaxes(x2d, role, rowwise=True, columnwise=False, recipe=recipe)[0]
        amax_columnwise = ops.compute_amaxes(x2d.to(torch.bfloat16), role, rowwise=False, columnwise=True,
                                             recipe=recipe)[1]
        return amax_rowwise, amax_columnwise
    return ops.compute_amaxes(x2d, role, rowwise=rowwise, columnwise=columnwise, recipe=recipe)


def quantize_operand(x2d: torch.Tensor, role: str, recipe: NVFP4Recipe, *, rowwise: bool = True,
                     columnwise: bool = True, amax_rowwise: torch.Tensor | None = None,
                     amax_columnwise: torch.Tensor | None = None, sr_seed: int | None = None,
                     sr_row_offset: int = 0) -> NVFP4Tensor:
    """ops.quantize, except that an RHT columnwise copy of a non-BF16 tensor is taken from its BF16 cast.
    No NaN/Inf check: the layers check their operands with LinearComm.check_finite."""
    if not (columnwise and needs_bf16_columnwise_source(role, recipe, x2d.dtype)):
        return hot_path.quantize(x2d, role, recipe, rowwise=rowwise, columnwise=columnwise, amax_rowwise=amax_rowwise,
                                 amax_columnwise=amax_columnwise, sr_seed=sr_seed, sr_row_offset=sr_row_offset)
    common = dict(recipe=recipe, sr_seed=sr_seed, sr_row_offset=sr_row_offset, check_finite=False)
    column = ops.quantize(x2d.to(torch.bfloat16), role, rowwise=False, columnwise=True,
                          amax_columnwise=amax_columnwise, **common)
    if not rowwise:
        return column.replace(dtype=x2d.dtype)
    row = ops.quantize(x2d, role, rowwise=True, columnwise=False, amax_rowwise=amax_rowwise, **common)
    return row.replace(columnwise_data=column.columnwise_data, columnwise_scale=column.columnwise_scale,
                       amax_columnwise=column.amax_columnwise, rht=column.rht)


def needs_columnwise_weight(recipe: NVFP4Recipe) -> bool:
    """Whether backward needs the weight's columnwise copy (the NVFP4 dgrad operand)."""
    return recipe.backward_mode == "default"


def check_features(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % BLOCK_SIZE:
        raise ValueError(f"{name}={value!r}: NVFP4 layers need a positive multiple of {BLOCK_SIZE} "
                         f"(1x16 / 16x16 blocks); use bf16_fallback=True (or torch.nn.Linear) for other sizes")


def check_weight_dtype(weight: torch.Tensor) -> None:
    if weight.dtype not in ops.INPUT_DTYPES:
        raise ValueError(f"weight.dtype={weight.dtype} (the layer's parameters): NVFP4 layers take {ops.INPUT_DTYPES}; "
                         f"build the layer with one of them (dtype=/params_dtype=), or use bf16_fallback=True")


def quantize_weight(weight: torch.Tensor, recipe: NVFP4Recipe, *, rowwise: bool = True,
                    columnwise: bool = True, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """The weight's NVFP4 copies (16x16 blocks when recipe.weight_2d); each copy's bytes do not depend on
    whether the other one is made in the same call. amax: the weight's amax when known (both copies share it:
    no RHT on weights), which saves its pass over the weight. No NaN/Inf check (LinearComm.check_finite)."""
    check_weight_dtype(weight)
    return hot_path.quantize(weight.detach(), "weight", recipe, rowwise=rowwise, columnwise=columnwise,
                             amax_rowwise=amax if rowwise else None, amax_columnwise=amax if columnwise else None)


_TENSOR_DATA = torch.Tensor.data  # the `.data` attribute of every tensor
_optimizer_steps = 0               # torch.optim optimizer steps taken by this process (see optimizer_steps())
_optimizer_step_hook = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def optimizer_steps() -> int:
    """How many torch.optim optimizer steps (any optimizer, fused ones included) this process has taken since
    the first call; counted by a global post-step hook that the first call registers."""
    global _optimizer_step_hook
    if _optimizer_step_hook is None:
        _optimizer_step_hook = register_optimizer_step_post_hook(_count_optimizer_step)
    return _optimizer_steps


class WeightParameter(torch.nn.Parameter):
    """The weight parameter of the NVFP4 layers: an nn.Parameter that counts the accesses to its `.data`.

    Writes through `.data` (`weight.data.mul_(0)`, `weight.data = t`, optimizers that update `p.data`) bypass
    the autograd version counter; WeightCache treats each access as a possible write.
    """

    data_accesses = 0

    @property
    def data(self):
        self.data_accesses += 1
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value):
        self.data_accesses += 1
        _TENSOR_DATA.__set__(self, value)


def weight_signature(weight: torch.Tensor) -> tuple:
    """What changes whenever the weight may have been written, short of reading its values: storage address and
    view, dtype, device, the autograd version counter (in-place ops on it or its views), the `.data` accesses of
    a WeightParameter, and the optimizer steps taken (fused optimizers do not bump the version counter)."""
    return (weight.data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(), weight.dtype,
            weight.device, weight._version, getattr(weight, "data_accesses", 0), optimizer_steps())


class WeightCache:
    """The quantized copies of one weight, reused (across micro-batches) while the weight is unchanged.

    A copy is reused only when the same parameter object, with the same storage, has the same
    weight_signature() as when it was quantized: any in-place op on it, `.data` access (WeightParameter),
    load_state_dict, re-assignment or torch.optim step (fused ones included) requantizes. CPU weights are
    also compared with a copy of their values at each reuse, which catches every other write (for example
    through a `.data` alias taken before the forward, or another tensor sharing the storage); on CUDA that
    comparison waits for the GPU, so it runs only with NVFP4_VERIFY_WEIGHT_CACHE=1 (else call invalidate()
    after such writes).
    """

    def __init__(self):
        self.invalidate()
        self.quantizations = 0  # how many times the weight was (re)quantized, for tests and logs

    def invalidate(self) -> None:
        self.key = None
        self.quantized: NVFP4Tensor | None = None
        self.weight_ref = self.storage_ref = None
        self.values: torch.Tensor | None = None  # the weight's values when quantized (verified reuse)

    def _current(self, weight: torch.Tensor, key: tuple) -> bool:
        if self.key != key or self.weight_ref() is not weight or self.storage_ref() is not weight.untyped_storage():
            return False
        return self.values is None or torch.equal(self.values, weight.detach())

    def get(self, weight: torch.Tensor, recipe: NVFP4Recipe, *, columnwise: bool = True) -> NVFP4Tensor:
        """The weight quantized with `recipe` (rowwise, and columnwise when asked), from the cache if current.

        Inside a CUDA graph capture the weight is always quantized, in the graph: optimizers update it in place
        between replays, which a replay cannot see from the host, so each replay quantizes the current values
        (and the cache is left empty, so that the next eager call quantizes again too)."""
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            self.invalidate()
            self.quantizations += 1
            return quantize_weight(weight, recipe, columnwise=columnwise)
        key = (weight_signature(weight), recipe, columnwise)
        if self.key is None or not self._current(weight, key):
            self.invalidate()
            self.quantized = quantize_weight(weight, recipe, columnwise=columnwise)
            self.key = key
            self.weight_ref, self.storage_ref = weakref.ref(weight), weakref.ref(weight.untyped_storage())
            if not weight.is_cuda or environment.VERIFY_WEIGHT_CACHE.read():
                self.values = weight.detach().clone()
            self.quantizations += 1
            logger.debug("quantized weight %s (version %d)", tuple(weight.shape), weight._version)
        return self.quantized


class LinearComm:
    """Communication around the three GEMMs of a linear layer. This base class is TP=1: none.

    Each step that the tensor-parallel subclasses (and the comm/GEMM overlap) change is one method;
    the "gather then GEMM" and "GEMM then reduce" steps are single calls so they can be pipelined.
    """

    def output_shape(self, input_shape: torch.Size, out_features: int) -> tuple:
        return (*input_shape[:-1], out_features)

    def quantize_input(self, x2d: torch.Tensor, recipe: NVFP4Recipe, *, columnwise: bool) -> NVFP4Tensor:
        """This rank's input, quantized (rowwise for fprop, columnwise for wgrad when asked)."""
        return quantize_operand(x2d, "activation", recipe, rowwise=True, columnwise=columnwise)

    def check_finite(self, operands: dict, layer_name: str) -> None:
        """Raise NonFiniteAmaxError if an operand ({"input" | "weight" | "gradient": NVFP4Tensor}) has a NaN/Inf
        amax, naming the operand and the layer (recipe.check_finite; docs/numerics.md §2)."""
        finite_check.check_operands({f"the {role} of {layer_name}": q for role, q in operands.items()})

    def fprop(self, xq: NVFP4Tensor, wq: NVFP4Tensor, *, bias: torch.Tensor | None, out_dtype: torch.dtype,
              recipe: NVFP4Recipe) -> torch.Tensor:
        """y = x . W^T [tokens, out] from the local quantized input."""
        return hot_path.gemm(xq, wq, a_copy="rowwise", b_copy="rowwise", out_dtype=out_dtype, bias=bias,
                             recipe=recipe)

    def input_to_save(self, xq: NVFP4Tensor) -> NVFP4Tensor:
        """What forward keeps of its quantized input for backward (an option may gather it here)."""
        return xq

    def input_for_wgrad(self, saved_input: NVFP4Tensor) -> Callable[[], NVFP4Tensor]:
        """Start bringing the saved input to the wgrad GEMM's token range; the callable finishes it."""
        return lambda: saved_input

    def quantize_grad_output(self, dy2d: torch.Tensor, recipe: NVFP4Recipe, *, sr_seed: int | None,
                             rowwise: bool, columnwise: bool) -> NVFP4Tensor:
        """This rank's output gradient, quantized (SR and RHT per the recipe)."""
        return quantize_operand(dy2d, "gradient", recipe, rowwise=rowwise, columnwise=columnwise, sr_seed=sr_seed)

    def grad_output_for_wgrad(self, dyq: NVFP4Tensor) -> Callable[[], NVFP4Tensor]:
        """Start bringing the output gradient's columnwise copy to the wgrad token range."""
        return lambda: dyq

    def dgrad(self, dyq: NVFP4Tensor, wq: NVFP4Tensor, *, out_dtype: torch.dtype,
              recipe: NVFP4Recipe) -> torch.Tensor:
        """dx = dy . W [tokens, in] for this rank's input."""
        return hot_path.gemm(dyq, wq, a_copy="rowwise", b_copy="columnwise", out_dtype=out_dtype, recipe=recipe)

    def dgrad_and_wgrad(self, dyq: NVFP4Tensor, wq: NVFP4Tensor, *, out_dtype: torch.dtype, recipe: NVFP4Recipe,
                        wgrad_step: Callable[[], None]) -> torch.Tensor:
        """dgrad(), with wgrad_step() (the layer's weight-gradient step) run exactly once where it hides the most
        communication; here after dgrad. The overlapped comms run it inside their transfers."""
        dx = self.dgrad(dyq, wq, out_dtype=out_dtype, recipe=recipe)
        wgrad_step()
        return dx

    # The unquantized backward modes (recipe.backward_mode "high_precision" and "dequantized").
    def unquantized_grad_output(self, dy2d: torch.Tensor) -> torch.Tensor:
        """The output gradient over the token range of the GEMMs, as given (all-gathered under row-parallel SP)."""
        return dy2d

    def unquantized_dgrad(self, dy2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dx = dy . W [tokens, in] in dy's dtype, for this rank's input."""
        return dy2d @ weight

    def unquantized_input_to_save(self, x2d: torch.Tensor) -> torch.Tensor:
        """What forward keeps of its unquantized input ("high_precision"; an option may gather it here)."""
        return x2d

    def unquantized_input_for_wgrad(self, saved_input: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start bringing the saved unquantized input to the wgrad GEMM's token range; the callable finishes it."""
        return lambda: saved_input


@dataclasses.dataclass
class LinearOptions:
    """Per-call settings of the linear Function besides its tensors."""

    recipe: NVFP4Recipe
    comm: LinearComm
    accumulate_into_main_grad: bool = False
    wgrad_store: list | None = None  # delay_wgrad: wgrad closures appended here, run by the layer's backward_dw()
    grad_enabled: bool = True  # autograd was recording at the call (else no backward copies are made)
    # Keep no weight copy between forward and backward: backward quantizes the (unchanged) weight again, only
    # the copy it needs. Less memory for layers that requantize every forward anyway (no WeightCache reuse).
    requantize_weight_in_backward: bool = False
    layer_name: str = "Linear"  # the layer, in error messages


def main_grad_target(weight: torch.Tensor, accumulate_into_main_grad: bool) -> torch.Tensor | None:
    """The buffer a wgrad GEMM accumulates into (weight.main_grad under accumulate_into_main_grad), or None (the
    GEMM returns a new gradient)."""
    if accumulate_into_main_grad:
        return getattr(weight, "main_grad", None)
    return None


def wait_for_main_grad(weight: torch.Tensor) -> None:
    """Make the current stream wait for the last accumulation into weight.main_grad when that ran on another CUDA
    stream (a backward run on a side stream, as CUDA graph capture and warm-up do)."""
    last = getattr(weight, "_main_grad_written", None)
    if last is not None and weight.main_grad.is_cuda:
        torch.cuda.current_stream(weight.main_grad.device).wait_event(last)


def _accumulate_in_stream_order(weight: torch.Tensor, compute: Callable) -> None:
    """compute(weight.main_grad) after the previous accumulation into it (wait_for_main_grad), recording when it
    was written."""
    buffer = weight.main_grad
    if not buffer.is_cuda:
        compute(buffer)
        return
    wait_for_main_grad(weight)
    compute(buffer)
    written = torch.cuda.Event()
    written.record(torch.cuda.current_stream(buffer.device))
    weight._main_grad_written = written


def deliver_weight_grad(weight: torch.Tensor, compute: Callable, accumulate_into_main_grad: bool,
                        delayed: bool):
    """Run a wgrad `compute(accumulate_into)` and return what backward returns for the weight.

    With accumulate_into_main_grad and a `weight.main_grad`, the gradient is added into main_grad by the
    GEMM and the returned gradient follows Megatron (a dummy when weight.grad_added_to_main_grad exists,
    else None). Delayed (Megatron delay_wgrad_compute): backward_dw() runs this later and the gradient is
    accumulated into weight.grad there.
    """
    if main_grad_target(weight, accumulate_into_main_grad) is not None:
        _accumulate_in_stream_order(weight, compute)
        if delayed:
            return None
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            return make(weight.shape, dtype=weight.dtype, device=weight.device)
        return None
    grad = compute(None)
    if delayed:
        with torch.no_grad():
            weight.grad = grad if weight.grad is None else weight.grad.add_(grad)
        return None
    return grad


def schedule_weight_grad(weight, compute, options: LinearOptions):
    """deliver_weight_grad now, or (delay_wgrad) queue it on the layer's store and return None."""
    if options.wgrad_store is None:
        return deliver_weight_grad(weight, compute, options.accumulate_into_main_grad, delayed=False)
    options.wgrad_store.append(
        lambda: deliver_weight_grad(weight, compute, options.accumulate_into_main_grad, delayed=True))
    return None


class NVFP4LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs in NVFP4; comm steps delegated to options.comm."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_q: NVFP4Tensor, options: LinearOptions):
        recipe, comm = options.recipe, options.comm
        x2d = x.reshape(-1, x.shape[-1])
        need_wgrad = ctx.needs_input_grad[1] and options.grad_enabled
        ctx.mode = mode = recipe.backward_mode
        xq = comm.quantize_input(x2d, recipe, columnwise=need_wgrad and mode == "default")
        if recipe.check_finite:
            comm.check_finite({"input": xq, "weight": weight_q}, options.layer_name)
        y2d = comm.fprop(xq.rowwise_only(), weight_q, bias=bias, out_dtype=x.dtype, recipe=recipe)
        if mode == "high_precision":  # backward takes x (kept here) and the weight parameter itself
            saved_x = comm.unquantized_input_to_save(x2d) if need_wgrad else None
            ctx.save_for_backward(saved_x, weight if options.grad_enabled else None)
        else:
            # Default: x's columnwise copy (wgrad) and W's columnwise copy (dgrad); dequantized: the rowwise
            # copies that fprop used.
            copy = "columnwise_only" if mode == "default" else "rowwise_only"
            saved_x = getattr(xq, copy)()
            saved_x = comm.input_to_save(saved_x) if need_wgrad else NVFP4Tensor(shape=xq.shape, dtype=xq.dtype)
            saved_w = getattr(weight_q, copy)()
            if options.requantize_weight_in_backward or not options.grad_enabled:
                saved_w = NVFP4Tensor(shape=weight_q.shape, dtype=weight_q.dtype)
            ctx.save_for_backward(*saved_x.tensors(), *saved_w.tensors())
            ctx.x_meta, ctx.w_meta = saved_x.metadata(), saved_w.metadata()
        ctx.weight_version = written_version(weight)
        ctx.weight_amax = weight_q.amax_rowwise if options.requantize_weight_in_backward else None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.options, ctx.weight = options, weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y2d.reshape(comm.output_shape(x.shape, y2d.shape[-1]))

    @staticmethod
    def backward(ctx, dy):
        options, weight = ctx.options, ctx.weight
        recipe, comm = options.recipe, options.comm
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2d = dy.reshape(-1, dy.shape[-1])
        grad_bias = dy2d.sum(dim=0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        deliver_wgrad = lambda wgrad: schedule_weight_grad(weight, wgrad, options)  # noqa: E731
        if ctx.mode == "high_precision":
            saved_x, saved_weight = ctx.saved_tensors
            finish_x = comm.unquantized_input_for_wgrad(saved_x) if need_wgrad else None
            dx2d, grad_weight = unquantized_backward(dy2d, lambda: saved_weight.to(dy2d.dtype), finish_x, comm,
                                                     ctx.x_dtype, weight.dtype, need_dgrad, deliver_wgrad)
        else:
            saved = ctx.saved_tensors
            saved_x = ctx.x_meta.with_tensors(saved[:6])
            weight_q = ctx.w_meta.with_tensors(saved[6:])
            if options.requantize_weight_in_backward and need_dgrad:
                weight_q = requantized_weight(weight, ctx.weight_version, ctx.weight_amax, recipe)
            if ctx.mode == "dequantized":
                dx2d, grad_weight = dequantized_backward(dy2d, saved_x, weight_q, comm, ctx.x_dtype, weight.dtype,
                                                         need_dgrad, need_wgrad, deliver_wgrad)
            else:
                dx2d, grad_weight = nvfp4_backward(dy2d, saved_x, weight_q, recipe, comm, ctx.x_dtype,
                                                   weight.dtype, need_dgrad, need_wgrad, deliver_wgrad,
                                                   options.layer_name)
        grad_x = dx2d.reshape(ctx.x_shape) if need_dgrad else None
        return grad_x, grad_weight, grad_bias, None, None


def written_version(weight: torch.Tensor) -> tuple:
    """What an in-place write or re-assignment of the weight changes (storage, view, version counter)."""
    return weight.data_ptr(), weight.storage_offset(), weight.stride(), weight._version


def requantized_weight(weight: torch.Tensor, forward_version: tuple, forward_amax: torch.Tensor,
                       recipe: NVFP4Recipe) -> NVFP4Tensor:
    """The weight copy backward needs, quantized again with forward's amax: the same bytes as forward's, the
    weight being unchanged."""
    if written_version(weight) != forward_version:
        raise RuntimeError("the weight was modified in place between forward and backward; with "
                           "requantize_weight_in_backward the backward GEMM would use the new values")
    columnwise = needs_columnwise_weight(recipe)
    return quantize_weight(weight, recipe, rowwise=not columnwise, columnwise=columnwise, amax=forward_amax)


def nvfp4_backward(dy2d, saved_x, weight_q, recipe, comm, x_dtype, weight_dtype, need_dgrad, need_wgrad,
                   deliver_wgrad: Callable, layer_name: str = "Linear"):
    """(dx [tokens, in] or None, deliver_wgrad(wgrad compute function) or None) with dgrad and wgrad in NVFP4.

    deliver_wgrad computes (or queues) the weight gradient; the comm runs it inside dgrad where that hides
    communication (LinearComm.dgrad_and_wgrad)."""
    if not (need_dgrad or need_wgrad):
        return None, None
    sr_seed = ops.draw_sr_seed(dy2d) if recipe.stochastic_rounding else None
    dyq = comm.quantize_grad_output(dy2d, recipe, sr_seed=sr_seed, rowwise=need_dgrad, columnwise=need_wgrad)
    if recipe.check_finite:
        comm.check_finite({"gradient": dyq}, layer_name)
    if not need_wgrad:
        return comm.dgrad(dyq.rowwise_only(), weight_q, out_dtype=x_dtype, recipe=recipe), None
    # Start the wgrad operands' gathers now, so they overlap the dgrad GEMM.
    finish_x = comm.input_for_wgrad(saved_x)
    finish_dy = comm.grad_output_for_wgrad(dyq.columnwise_only())

    def wgrad(accumulate_into):
        return hot_path.gemm(finish_dy(), finish_x(), a_copy="columnwise", b_copy="columnwise",
                             out_dtype=weight_dtype, accumulate_into=accumulate_into, recipe=recipe)

    delivered = []

    def wgrad_step():
        if delivered:
            raise RuntimeError(f"{type(comm).__name__}.dgrad_and_wgrad ran the wgrad step twice")
        delivered.append(deliver_wgrad(wgrad))
    if not need_dgrad:
        wgrad_step()
        return None, delivered[0]
    dx2d = comm.dgrad_and_wgrad(dyq.rowwise_only(), weight_q, out_dtype=x_dtype, recipe=recipe, wgrad_step=wgrad_step)
    if not delivered:
        raise RuntimeError(f"{type(comm).__name__}.dgrad_and_wgrad returned without running the wgrad step")
    return dx2d, delivered[0]


def unquantized_backward(dy2d, weight_operand: Callable[[], torch.Tensor],
                         finish_x: Callable[[], torch.Tensor] | None, comm, x_dtype, weight_dtype, need_dgrad,
                         deliver_wgrad: Callable):
    """(dx [tokens, in] or None, deliver_wgrad(wgrad compute function) or None) with dgrad and wgrad in dy's dtype
    on the unquantized output gradient, wgrad after dgrad. weight_operand() gives W [out, in] in dy's dtype;
    finish_x() (None: no wgrad) the input [tokens, in] over the wgrad token range in dy's dtype, its gather (if
    any) already started."""
    if not (need_dgrad or finish_x is not None):
        return None, None
    dy_full = comm.unquantized_grad_output(dy2d)
    dx2d = comm.unquantized_dgrad(dy_full, weight_operand()).to(x_dtype) if need_dgrad else None
    if finish_x is None:
        return dx2d, None

    def wgrad(accumulate_into):
        grad = dy_full.t() @ finish_x()
        if accumulate_into is not None:
            return accumulate_into.add_(grad.to(torch.float32))
        return grad.to(weight_dtype)
    return dx2d, deliver_wgrad(wgrad)


def dequantized_backward(dy2d, saved_x, weight_q, comm, x_dtype, weight_dtype, need_dgrad, need_wgrad,
                         deliver_wgrad: Callable):
    """Backward mode "dequantized" (docs/numerics.md §10): dgrad and wgrad in dy's dtype on the rowwise copies of
    x and W that fprop used, dequantized to dy's dtype (x's copy gathered in NVFP4 before dequantizing)."""
    finish_x = None
    if need_wgrad:
        finish_saved = comm.input_for_wgrad(saved_x)  # started before dgrad, so the gather overlaps it

        def finish_x():
            return ops.dequantize(finish_saved(), dtype=dy2d.dtype, copy="rowwise").reshape(-1, saved_x.cols)
    return unquantized_backward(dy2d, lambda: ops.dequantize(weight_q, dtype=dy2d.dtype, copy="rowwise"),
                                finish_x, comm, x_dtype, weight_dtype, need_dgrad, deliver_wgrad)


class BF16LinearFunction(torch.autograd.Function):
    """y = x W^T + b in the activation dtype (the BF16 fallback), with the same wgrad hooks as NVFP4."""

    @staticmethod
    def forward(ctx, x, weight, bias, options: LinearOptions):
        w = weight.to(x.dtype)
        ctx.save_for_backward(x, w)
        ctx.options, ctx.weight = options, weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        weight, options = ctx.weight, ctx.options
        dy2d = dy.reshape(-1, dy.shape[-1])
        grad_x = (dy2d @ w).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_bias = dy2d.sum(dim=0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            def wgrad(accumulate_into):
                grad = dy2d.t() @ x.reshape(-1, x.shape[-1])
                if accumulate_into is not None:
                    return accumulate_into.add_(grad.to(torch.float32))
                return grad.to(weight.dtype)
            grad_weight = schedule_weight_grad(weight, wgrad, options)
        return grad_x, grad_weight, grad_bias, None


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe, *,
                 weight_q: NVFP4Tensor, comm: LinearComm | None = None, accumulate_into_main_grad: bool = False,
                 wgrad_store: list | None = None, requantize_weight_in_backward: bool = False,
                 layer_name: str = "Linear") -> torch.Tensor:
    """y = x W^T (+ bias) in NVFP4 for x [..., in]; weight_q is `weight` quantized (see WeightCache), at least
    its rowwise copy, and its columnwise copy too unless requantize_weight_in_backward (LinearOptions).
    layer_name: the layer in error messages."""
    grad_enabled = torch.is_grad_enabled()
    tokens = x.numel() // x.shape[-1]
    if grad_enabled and weight.requires_grad and recipe.backward_mode == "default" and tokens % BLOCK_SIZE:
        raise ValueError(f"input.shape={tuple(x.shape)}: training needs the token count (product of the leading "
                         f"dims, {tokens}) to be a multiple of {BLOCK_SIZE} for the wgrad copies; pad the batch "
                         f"explicitly or run under torch.no_grad()")
    options = LinearOptions(recipe=recipe, comm=comm or LinearComm(),
                            accumulate_into_main_grad=accumulate_into_main_grad, wgrad_store=wgrad_store,
                            grad_enabled=grad_enabled, requantize_weight_in_backward=requantize_weight_in_backward,
                            layer_name=layer_name)
    return NVFP4LinearFunction.apply(x, weight, bias, weight_q, options)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                accumulate_into_main_grad: bool = False, wgrad_store: list | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) in x's dtype, with the main_grad / delayed-wgrad hooks of the NVFP4 path."""
    options = LinearOptions(recipe=None, comm=LinearComm(), accumulate_into_main_grad=accumulate_into_main_grad,
                            wgrad_store=wgrad_store)
    return BF16LinearFunction.apply(x, weight, bias, options)


def check_activation(x: torch.Tensor, in_features: int, weight: torch.Tensor | None = None) -> None:
    """ValueError naming the problem when x cannot be the input of a layer with in_features (and `weight`)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ops.INPUT_DTYPES:
        raise ValueError(f"input.dtype={x.dtype}: allowed are {ops.INPUT_DTYPES}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"input.shape={tuple(x.shape)}: the last dim must be in_features={in_features}")
    if weight is not None and x.device != weight.device:
        raise ValueError(f"input.device={x.device}: the layer's weight is on {weight.device}; move one of them")


def check_parameter_dtype(dtype) -> None:
    """The dtype= of an NVFP4 layer's parameters: None (torch's default) or one that NVFP4 quantizes."""
    if dtype is not None and dtype not in ops.INPUT_DTYPES:
        raise ValueError(f"dtype={dtype}: NVFP4 layers take parameters in {ops.INPUT_DTYPES}; use bf16_fallback=True "
                         f"for other dtypes")


def name_layers(model: torch.nn.Module) -> None:
    """Set every NVFP4 layer's `layer_name` (matched by recipe maps, and used in its error messages) to its
    qualified name in `model` (call it on the model itself, before wrapping it in DDP or similar)."""
    for qualified, module in model.named_modules():
        caches = getattr(module, "weight_caches", None) or [getattr(module, "weight_cache", None)]
        if any(isinstance(cache, WeightCache) for cache in caches):  # nv.Linear and the like; GroupedLinear
            module.layer_name = qualified or type(module).__name__


def describe_layer(module: torch.nn.Module) -> str:
    """The layer in error messages: its layer_name (name_layers), else the name Megatron-Core gave it, else its
    class and sizes."""
    for name in (getattr(module, "layer_name", None), getattr(module, "name", None)):
        if isinstance(name, str) and name:
            return name
    return f"{type(module).__name__}(in_features={module.in_features}, out_features={module.out_features})"


class Linear(torch.nn.Module):
    """Drop-in for torch.nn.Linear whose three GEMMs run in NVFP4 (docs/numerics.md §3).

    Same constructor arguments, parameters (in `dtype`) and state_dict as torch.nn.Linear, plus:
    recipe: this layer's NVFP4Recipe, or a RecipeMap matched against layer_name (nvfp4_dist/recipe_map.py);
      None: the enclosing nvfp4_dist.autocast's (its recipes= map, then its recipe), else from the environment.
    bf16_fallback: run this layer unquantized in the activation dtype (first/last layers, docs/numerics.md §10).
    accumulate_into_main_grad: add wgrad into weight.main_grad (FP32) in the GEMM (Megatron).
    delay_wgrad: backward skips wgrad; backward_dw() runs it later (Megatron delay_wgrad_compute).
    The quantized weight is cached until the parameter changes (see WeightCache).
    Token count (product of the leading dims) must be a multiple of 16 for the default backward (its wgrad copies
    are blocked along tokens; recipe.backward_mode high_precision and dequantized take any count); an empty
    batch (no tokens) gives an empty output and zero weight gradients, as torch.nn.Linear does.
    layer_name: the module name that recipe maps match, and the layer in error messages (name_layers sets it;
      default: None, shown as class and sizes).
    last_recipe: the NVFP4Recipe the last forward ran with; None when it ran in BF16.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: NVFP4Recipe | RecipeMap | None = None, bf16_fallback: bool = False,
                 accumulate_into_main_grad: bool = False, delay_wgrad: bool = False):
        super().__init__()
        if not bf16_fallback:
            check_features("in_features", in_features)
            check_features("out_features", out_features)
            check_parameter_dtype(dtype)
        check_layer_recipe(recipe)
        self.in_features, self.out_features = in_features, out_features
        self.layer_name: str | None = None
        self.last_recipe: NVFP4Recipe | None = None
        self.recipe, self.bf16_fallback = recipe, bf16_fallback
        self.accumulate_into_main_grad, self.delay_wgrad = accumulate_into_main_grad, delay_wgrad
        factory = dict(device=device, dtype=dtype)
        self.weight = WeightParameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.weight_cache = WeightCache()
        self.wgrad_store: list = []
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn.Linear's initialisation (same RNG draws, so equal seeds give equal parameters)."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def invalidate_weight_cache(self) -> None:
        """Force requantizing the weight at the next forward (after writes through weight.data)."""
        self.weight_cache.invalidate()

    def resolved_recipe(self) -> NVFP4Recipe | None:
        """The recipe a forward now runs with (nvfp4_dist/autocast.py has the order); None: the BF16 fallback
        (bf16_fallback, autocast(enabled=False), or a recipe map's "bf16" entry)."""
        if self.bf16_fallback or not nvfp4_enabled():
            return None
        return resolve_layer_recipe(self.recipe, self.layer_name, describe_layer(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.resolved_recipe()
        if recipe is not None:
            check_weight_dtype(self.weight)
        check_activation(x, self.in_features, self.weight)
        store = self.wgrad_store if self.delay_wgrad else None
        self.last_recipe = recipe if x.numel() else None
        if self.last_recipe is None:
            return bf16_linear(x, self.weight, self.bias, accumulate_into_main_grad=self.accumulate_into_main_grad,
                               wgrad_store=store)
        weight_q = self.weight_cache.get(self.weight, recipe, columnwise=needs_columnwise_weight(recipe))
        return nvfp4_linear(x, self.weight, self.bias, recipe, weight_q=weight_q,
                            accumulate_into_main_grad=self.accumulate_into_main_grad, wgrad_store=store,
                            layer_name=describe_layer(self))

    def backward_dw(self) -> None:
        """Run the wgrad GEMMs that backward deferred (delay_wgrad=True), oldest first."""
        while self.wgrad_store:
            self.wgrad_store.pop(0)()

    def extra_repr(self) -> str:
        mode = "bf16_fallback" if self.bf16_fallback else "nvfp4"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {mode}"
