"""LayerNormLinear and LayerNormMLP: a norm (and an activation) feeding NVFP4 linears, each producer fused with
the cast of its output (nvfp4_dist/fused.py), so that neither the norm's nor the activation's BF16 output is
written and read back.

The linear's autograd function (nvfp4_dist.linear) stays as it is: a fused producer is an autograd function
whose output is a stride-0 placeholder of the producer's output shape (what the linear's backward sends
the input gradient to), while the NVFP4 copies it made reach the linear through its comm (ProducerInputComm).
Backward: the linear's dgrad gives the gradient of the producer's output, the producer's backward the rest
(the norm from its input and statistics, the activation from fc1's output, which it saves and nothing more).

Without fusion (recipe.fused_producers False, a non-BF16 producer output, BF16 fallback) the same norm and
activation write their output and the linear quantizes it: the same bytes, one more round trip to memory.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from nvfp4_dist.fused import (FUSED_OUTPUT_DTYPE, NORMALIZATIONS, activation, activation_backward, fusion_applies,
                              norm, norm_backward, norm_output_dtype, quantize_activation_output,
                              quantize_norm_output)
from nvfp4_dist.linear import (LinearComm, Linear, bf16_linear, check_activation, check_features,
                               needs_columnwise_weight, nvfp4_linear)
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap
from nvfp4_dist.reference.fused_producers import ACTIVATIONS, activation_output_shape
from nvfp4_dist.tensor import NVFP4Tensor


@dataclasses.dataclass
class ProducerCast:
    """How a fused producer casts its output, and (between its forward and the linear's) the copies it made."""

    recipe: NVFP4Recipe
    columnwise: bool                                      # the wgrad copy too
    reduce_amaxes: Callable[[list], object] | None = None  # the amax all-reduce between the passes (SP)
    quantized: NVFP4Tensor | None = None


class ProducerInputComm:
    """A linear's comm whose input copies come from a fused producer's cast instead of quantize_input's.

    Every other step is the wrapped comm's (the tensor-parallel gathers and reductions included); a comm that
    carries its quantized input round the fprop ring (parallel/overlap.py carry_input) gets the producer's.
    """

    def __init__(self, comm: LinearComm, cast: ProducerCast):
        self.comm, self.cast = comm, cast

    def quantize_input(self, x2d: torch.Tensor, recipe: NVFP4Recipe, *, columnwise: bool) -> NVFP4Tensor:
        quantized, self.cast.quantized = self.cast.quantized, None
        if quantized is None or (columnwise and not quantized.has_columnwise):
            raise RuntimeError("the fused producer did not make the copies the linear asks for "
                               f"(columnwise={columnwise}); its forward must run right before the linear's")
        carry = getattr(self.comm, "carry_input", None)  # a ring-pipelined comm keeps what it carries in fprop
        return carry(quantized) if carry is not None else quantized

    def __getattr__(self, name: str):
        return getattr(self.comm, name)


def producer_output_placeholder(shape, device) -> torch.Tensor:
    """What autograd sees of a fused producer's output: its shape and dtype, no storage."""
    return torch.empty((), dtype=FUSED_OUTPUT_DTYPE, device=device).expand(*shape)


class _NormCastFunction(torch.autograd.Function):
    """Forward: the norm's output quantized (into cast.quantized); backward: the norm's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalization, eps, cast: ProducerCast):
        cast.quantized, mean, rstd = quantize_norm_output(
            x, weight, bias, normalization=normalization, eps=eps, recipe=cast.recipe, columnwise=cast.columnwise,
            reduce_amaxes=cast.reduce_amaxes)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.normalization = normalization
        return producer_output_placeholder(x.shape, x.device)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        grads = norm_backward(dy, x, weight, bias, mean, rstd, ctx.normalization, ctx.needs_input_grad)
        return (*grads, None, None, None)


class _ActivationCastFunction(torch.autograd.Function):
    """Forward: the activation's output quantized (into cast.quantized); backward: the activation's backward."""

    @staticmethod
    def forward(ctx, h, activation_name, cast: ProducerCast):
        cast.quantized = quantize_activation_output(h, activation=activation_name, recipe=cast.recipe,
                                                    columnwise=cast.columnwise, reduce_amaxes=cast.reduce_amaxes)
        ctx.save_for_backward(h)
        ctx.activation = activation_name
        return producer_output_placeholder(activation_output_shape(h.shape, activation_name), h.device)

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return activation_backward(da, h, ctx.activation), None, None


def _cast_for(weight: torch.Tensor, recipe: NVFP4Recipe, reduce_amaxes) -> ProducerCast:
    """The copies the linear's forward will ask for: the columnwise one when it will compute an NVFP4 wgrad."""
    columnwise = torch.is_grad_enabled() and weight.requires_grad and recipe.backward_mode == "default"
    return ProducerCast(recipe=recipe, columnwise=columnwise, reduce_amaxes=reduce_amaxes)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, recipe: NVFP4Recipe, *, normalization: str, eps: float,
                weight_q: NVFP4Tensor, comm: LinearComm | None = None,
                reduce_amaxes: Callable[[list], object] | None = None, **linear_options) -> torch.Tensor:
    """nvfp4_linear(norm(x) in BF16, ...) with the norm fused into the cast of the linear's input.

    reduce_amaxes: all-reduces the input's amaxes between the norm's passes (the comm's group under sequence
    parallelism). linear_options: nvfp4_linear's keywords (accumulate_into_main_grad, wgrad_store, ...).
    """
    cast = _cast_for(weight, recipe, reduce_amaxes)
    produced = _NormCastFunction.apply(x, norm_weight, norm_bias, normalization, float(eps), cast)
    return nvfp4_linear(produced, weight, bias, recipe, weight_q=weight_q,
                        comm=ProducerInputComm(comm or LinearComm(), cast), **linear_options)


def activation_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe, *,
                      activation_name: str, weight_q: NVFP4Tensor, comm: LinearComm | None = None,
                      reduce_amaxes: Callable[[list], object] | None = None, **linear_options) -> torch.Tensor:
    """nvfp4_linear(activation(h) in BF16, ...) with the activation fused into the cast of the linear's input."""
    cast = _cast_for(weight, recipe, reduce_amaxes)
    produced = _ActivationCastFunction.apply(h, activation_name, cast)
    return nvfp4_linear(produced, weight, bias, recipe, weight_q=weight_q,
                        comm=ProducerInputComm(comm or LinearComm(), cast), **linear_options)


@dataclasses.dataclass
class NormProducer:
    """LayerNorm / RMSNorm in front of a linear, its parameters as the norm computes with them."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    normalization: str
    eps: float

    def output_dtype(self, x: torch.Tensor) -> torch.dtype:
        return norm_output_dtype(x)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.weight, self.bias, normalization=self.normalization, eps=self.eps,
                    out_dtype=self.output_dtype(x))

    def fused_linear(self, x, weight, bias, recipe, **options) -> torch.Tensor:
        return norm_linear(x, self.weight, self.bias, weight, bias, recipe, normalization=self.normalization,
                           eps=self.eps, **options)


@dataclasses.dataclass
class ActivationProducer:
    """GELU / SwiGLU of fc1's output in front of a linear."""

    name: str

    def output_dtype(self, h: torch.Tensor) -> torch.dtype:
        return h.dtype

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return activation(h, activation=self.name)

    def fused_linear(self, h, weight, bias, recipe, **options) -> torch.Tensor:
        return activation_linear(h, weight, bias, recipe, activation_name=self.name, **options)


def produced_linear(producer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe,
                    *, weight_q: NVFP4Tensor, comm: LinearComm | None = None,
                    reduce_amaxes: Callable[[list], object] | None = None, **linear_options) -> torch.Tensor:
    """nvfp4_linear of a producer's output (NormProducer, ActivationProducer) given the producer's input x: fused
    into the input's cast where fusion_applies, else the output formed first (the same bytes either way)."""
    if fusion_applies(recipe, producer.output_dtype(x)):
        return producer.fused_linear(x, weight, bias, recipe, weight_q=weight_q, comm=comm,
                                     reduce_amaxes=reduce_amaxes, **linear_options)
    return nvfp4_linear(producer.output(x), weight, bias, recipe, weight_q=weight_q, comm=comm, **linear_options)


class LayerNormLinear(Linear):
    """A norm (LayerNorm or RMSNorm over in_features) followed by an NVFP4 linear, fused (TE's LayerNormLinear).

    Linear's arguments and parameters (weight, bias), plus layer_norm_weight (and layer_norm_bias for
    LayerNorm) in `dtype`: eps, normalization, zero_centered_gamma (the norm weight stored as gamma - 1).
    The norm computes with its parameters in the input's dtype, in FP32 (nvfp4_dist.fused.norm); its output
    has the input's dtype (the autocast dtype under torch.autocast). Where that output is BF16 and the
    recipe's fused_producers is on, the norm is fused into the input's cast.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, eps: float = 1e-5, *,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False, device=None, dtype=None,
                 recipe: NVFP4Recipe | RecipeMap | None = None, bf16_fallback: bool = False,
                 accumulate_into_main_grad: bool = False, delay_wgrad: bool = False):
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={normalization!r}: allowed values are {NORMALIZATIONS}")
        check_features("in_features", in_features)  # the norm's cast works on 16-blocks of its width
        if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"eps={eps!r}: must be a finite number > 0")
        super().__init__(in_features, out_features, bias, device, dtype, recipe=recipe, bf16_fallback=bf16_fallback,
                         accumulate_into_main_grad=accumulate_into_main_grad, delay_wgrad=delay_wgrad)
        self.eps, self.normalization, self.zero_centered_gamma = float(eps), normalization, zero_centered_gamma
        factory = dict(device=device, dtype=dtype)
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(in_features, **factory))
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.empty(in_features, **factory))
        else:
            self.register_parameter("layer_norm_bias", None)
        self.reset_norm_parameters()

    def reset_norm_parameters(self) -> None:
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()

    def norm_parameters(self, dtype: torch.dtype):
        """(weight, bias) of the norm as it computes with them: gamma in `dtype` (and beta)."""
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        bias = None if self.layer_norm_bias is None else self.layer_norm_bias.to(dtype)
        return weight.to(dtype), bias

    def producer(self, x: torch.Tensor) -> NormProducer:
        """The norm in front of the linear, for input x."""
        weight, bias = self.norm_parameters(x.dtype)
        return NormProducer(weight, bias, self.normalization, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation(x, self.in_features)
        return linear_after_producer(self, self.producer(x), x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalization={self.normalization}, eps={self.eps}"


def linear_after_producer(linear: Linear, producer, x: torch.Tensor) -> torch.Tensor:
    """linear(producer(x)) with the linear's recipe, weight cache and wgrad settings: the producer's output fused
    into the linear's NVFP4 input where the recipe allows (produced_linear), BF16 where the recipe resolves to None."""
    store = linear.wgrad_store if linear.delay_wgrad else None
    options = dict(accumulate_into_main_grad=linear.accumulate_into_main_grad, wgrad_store=store)
    recipe = linear.resolved_recipe()
    linear.last_recipe = recipe
    if recipe is None:
        return bf16_linear(producer.output(x), linear.weight, linear.bias, **options)
    weight_q = linear.weight_cache.get(linear.weight, recipe, columnwise=needs_columnwise_weight(recipe))
    return produced_linear(producer, x, linear.weight, linear.bias, recipe, weight_q=weight_q, **options)


class LayerNormMLP(torch.nn.Module):
    """norm -> fc1 -> activation -> fc2 with NVFP4 linears (TE's LayerNormMLP), both producers fused.

    fc1: LayerNormLinear(hidden_size, ffn_hidden_size, or 2 * ffn_hidden_size for SwiGLU: [gate | up]);
    activation: "gelu" (erf) or "swiglu"; fc2: Linear(ffn_hidden_size, hidden_size). fc2's input (the
    activation's output) is quantized in the activation's passes where it is BF16 and the recipe's
    fused_producers is on. Other arguments as LayerNormLinear's, for both linears.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, eps: float = 1e-5, *,
                 normalization: str = "LayerNorm", activation: str = "gelu", zero_centered_gamma: bool = False,
                 device=None, dtype=None, recipe: NVFP4Recipe | RecipeMap | None = None, bf16_fallback: bool = False,
                 accumulate_into_main_grad: bool = False, delay_wgrad: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: allowed values are {ACTIVATIONS}")
        check_features("ffn_hidden_size", ffn_hidden_size)
        self.activation = activation
        common = dict(device=device, dtype=dtype, recipe=recipe, bf16_fallback=bf16_fallback,
                      accumulate_into_main_grad=accumulate_into_main_grad, delay_wgrad=delay_wgrad)
        fc1_out = ffn_hidden_size * (2 if activation == "swiglu" else 1)
        self.fc1 = LayerNormLinear(hidden_size, fc1_out, bias, eps, normalization=normalization,
                                   zero_centered_gamma=zero_centered_gamma, **common)
        self.fc2 = Linear(ffn_hidden_size, hidden_size, bias, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_after_producer(self.fc2, ActivationProducer(self.activation), self.fc1(x))

    def backward_dw(self) -> None:
        """Run both linears' deferred wgrad GEMMs (delay_wgrad=True)."""
        self.fc1.backward_dw()
        self.fc2.backward_dw()

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
