"""NVFP4 GroupedLinear: E experts' linear layers over one token tensor split by expert (mixture-of-experts).

Definition: GroupedLinear(E, in, out)(x, split_sizes) equals, bit for bit, running x's rows
[o_e, o_e + m_e) (m_e = split_sizes[e], o_e the sum of the earlier sizes) through expert e's own
nvfp4_dist.Linear with the same recipe and concatenating the outputs; gradients likewise. So each expert's
tokens are quantized with that expert's own amax (both copies, RHT on the columnwise one), each weight with
its own amax (16x16 blocks by default), and an expert with no tokens gets no quantization and zero weight (and
bias) gradients, as nv.Linear gives for an empty batch.

Stochastic rounding: one seed per backward call (ops.draw_sr_seed, drawn once when at least one expert has
tokens), shared by every expert; expert e quantizes its output gradient with sr_row_offset = o_e. Expert e's
gradient therefore gets the random bits of rows [o_e, o_e + m_e) of the whole grouped gradient quantized with
that seed (docs/numerics.md §7), and a loop of per-expert nv.Linear layers reproduces them when each layer's
gradient quantization is given that seed and offset (tests/test_grouped_linear.py does so).

Stages: on CUDA, each quantization stage (the activations' copies in forward, the output gradients' in backward,
the stale cached weights, stacked) is one grouped quantization (nvfp4_dist/grouped_quantize.py): a fixed number
of launches whatever the number of experts (the amaxes, one segment reduction, one cast), each expert's codes,
scales and amaxes byte for byte those of its own ops.quantize. The CPU reference, the 4over6 and row-scaled
recipes and CUDA graph captures quantize per expert (one ops.quantize per expert and operand), the definition.
Expert e's columnwise copy is then a column slice of the grouped copy of x^T (a strided view); the weights'
copies are contiguous. Each GEMM stage (fprop, dgrad, wgrad) runs every expert's GEMM in one C++ call where the
backend is the Hopper emulation (hot_path.grouped_gemm: per expert the kernels of gemm(), so the same bytes, without
a Python call per expert); elsewhere (the CPU reference, Blackwell's cuBLASLt, grouped_gemm=False) one
hot_path.gemm() per expert with tokens. Both are the bit-identical definition above.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import weakref

import torch

from nvfp4_dist import environment, finite_check, hot_path, ops
from nvfp4_dist.autocast import nvfp4_enabled, resolve_layer_recipe
from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.grouped_quantize import check_segments, quantize_segments, segment_offsets, segmented_kernels_apply
from nvfp4_dist.linear import (WeightCache, WeightParameter, bf16_linear, check_activation, check_features,
                               check_parameter_dtype, check_weight_dtype, deliver_weight_grad, main_grad_target,
                               wait_for_main_grad, weight_signature)
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap, check_layer_recipe
from nvfp4_dist.tensor import NVFP4Tensor

logger = logging.getLogger("nvfp4_dist")


def check_split_sizes(split_sizes, num_experts: int, rows: int) -> list[int]:
    """split_sizes as a list of E non-negative ints summing to `rows`; ValueError naming the problem otherwise."""
    return check_segments(split_sizes, rows, columnwise=False, num_experts=num_experts)


# ---------------------------------------------------------------------------------------------------------------
# The autograd Function.

@dataclasses.dataclass
class GroupedOptions:
    """Per-call settings of GroupedLinearFunction besides its tensors."""

    recipe: NVFP4Recipe
    split_sizes: list
    weight_qs: list            # per expert: the NVFP4Tensor of its weight, or None (no tokens)
    num_experts: int
    has_bias: bool
    grouped_gemm: bool
    accumulate_into_main_grad: bool = False
    wgrad_store: list | None = None
    grad_enabled: bool = True
    layer_name: str = "GroupedLinear"
    rowwise_input: NVFP4Tensor | None = None  # fprop's input copy, given (NVFP4 MoE dispatch)


def _gemms(options: GroupedOptions, a_ops: list, a_copy: str, b_ops: list, b_copy: str, outs: list, *,
           biases: list | None = None) -> None:
    """outs[i] = A_i . B_i^T (+ biases[i]) for the experts' operand pairs: as many as it takes in one grouped call
    (hot_path.grouped_gemm, with grouped_gemm on), the rest by one hot_path.gemm() each; the same bytes either way."""
    done = hot_path.grouped_gemm(a_ops, a_copy, b_ops, b_copy, outs, recipe=options.recipe, biases=biases) \
        if options.grouped_gemm else 0
    for i in range(done, len(a_ops)):
        hot_path.gemm(a_ops[i], b_ops[i], a_copy=a_copy, b_copy=b_copy, out_dtype=outs[i].dtype,
                      bias=None if biases is None else biases[i], recipe=options.recipe, out=outs[i])


def _active(split_sizes: list) -> list[int]:
    """The experts that have tokens, in order."""
    return [e for e, size in enumerate(split_sizes) if size]


def _check_finite(operands: dict, layer_name: str) -> None:
    finite_check.check_operands({f"the {role} of {layer_name}": q for role, q in operands.items()})


class GroupedLinearFunction(torch.autograd.Function):
    """y = [x_e W_e^T + b_e]_e with every GEMM in NVFP4 (module docstring); args: x, options, weights, biases."""

    @staticmethod
    def forward(ctx, x, options: GroupedOptions, *params):
        recipe, sizes = options.recipe, options.split_sizes
        experts = options.num_experts
        weights = params[:experts]
        biases = params[experts:] if options.has_bias else (None,) * experts
        x2d = x.reshape(-1, x.shape[-1])
        offsets = segment_offsets(sizes)
        active = _active(sizes)
        need_wgrad = any(ctx.needs_input_grad[2:2 + experts]) and options.grad_enabled
        given = options.rowwise_input
        x_qs = {}
        if given is None:
            parts = quantize_segments(x2d, sizes, "activation", recipe, rowwise=True, columnwise=need_wgrad)
            x_qs = {e: parts[e] for e in active}
        else:  # fprop takes the given rowwise copy; the wgrad copy is quantized from x
            columns = quantize_segments(x2d, sizes, "activation", recipe, rowwise=False, columnwise=True) \
                if need_wgrad and active else [None] * experts
            x_qs = {e: (given.rowwise_rows(offsets[e], offsets[e + 1]), columns[e]) for e in active}
        x_rows = {e: q[0] if isinstance(q, tuple) else q.rowwise_only() for e, q in x_qs.items()}
        x_columns = {e: q[1] if isinstance(q, tuple) else (q.columnwise_only() if need_wgrad else None)
                     for e, q in x_qs.items()}
        if recipe.check_finite:
            operands = {}
            for e in active:
                operands[f"input (expert {e})"] = x_rows[e]
                if x_columns[e] is not None:
                    operands[f"input's wgrad copy (expert {e})"] = x_columns[e]
                operands[f"weight (expert {e})"] = options.weight_qs[e]
            _check_finite(operands, options.layer_name)
        out_features = weights[0].shape[0]
        y2d = torch.empty(x2d.shape[0], out_features, dtype=x.dtype, device=x.device)
        _gemms(options, [x_rows[e] for e in active], "rowwise", [options.weight_qs[e] for e in active], "rowwise",
               [y2d[offsets[e]:offsets[e + 1]] for e in active],
               biases=[biases[e] for e in active] if options.has_bias else None)
        saved, metas = [], []
        for e in range(experts):
            if e in x_qs:
                xs = x_columns[e] if need_wgrad else NVFP4Tensor(shape=x_rows[e].shape, dtype=x.dtype)
                ws = options.weight_qs[e].columnwise_only()
            else:
                xs = ws = NVFP4Tensor(shape=torch.Size((0, 0)), dtype=x.dtype)
            saved += [*xs.tensors(), *ws.tensors()]
            metas.append((xs.metadata(), ws.metadata()))
        ctx.save_for_backward(*saved)
        ctx.metas, ctx.options = metas, options
        ctx.weights = weights
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        return y2d.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        options, weights = ctx.options, ctx.weights
        recipe, sizes, experts = options.recipe, options.split_sizes, options.num_experts
        offsets, active = segment_offsets(sizes), _active(sizes)
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrad = [ctx.needs_input_grad[2 + e] for e in range(experts)]
        need_bgrad = [options.has_bias and ctx.needs_input_grad[2 + experts + e] for e in range(experts)]
        dy2d = dy.reshape(-1, dy.shape[-1])
        saved = ctx.saved_tensors
        x_saved, w_saved = {}, {}
        for e in range(experts):
            x_meta, w_meta = ctx.metas[e]
            x_saved[e] = x_meta.with_tensors(saved[12 * e:12 * e + 6])
            w_saved[e] = w_meta.with_tensors(saved[12 * e + 6:12 * e + 12])
        grad_biases = [dy2d[offsets[e]:offsets[e + 1]].sum(dim=0).to(ctx.bias_dtypes[e]) if need_bgrad[e] else None
                       for e in range(experts)]
        wgrad_active = [e for e in active if need_wgrad[e]]
        quantized = need_dgrad or wgrad_active
        sr_seed = ops.draw_sr_seed(dy2d) if recipe.stochastic_rounding and active and quantized else None
        dy_qs = {}
        if quantized:  # one grouped quantization (the copies an expert does not need are dropped)
            columnwise = bool(wgrad_active)
            parts = quantize_segments(dy2d, sizes, "gradient", recipe, rowwise=need_dgrad, columnwise=columnwise,
                                      sr_seed=sr_seed)
            for e in active:
                if need_wgrad[e]:
                    dy_qs[e] = parts[e]
                elif need_dgrad:
                    dy_qs[e] = parts[e].rowwise_only().replace(rht=False) if columnwise else parts[e]
        if recipe.check_finite and dy_qs:
            _check_finite({f"gradient (expert {e})": q for e, q in dy_qs.items()}, options.layer_name)
        grad_x = None
        if need_dgrad:
            dx2d = torch.zeros(dy2d.shape[0], weights[0].shape[1], dtype=ctx.x_dtype, device=dy.device)
            _gemms(options, [dy_qs[e].rowwise_only() for e in active], "rowwise", [w_saved[e] for e in active],
                   "columnwise", [dx2d[offsets[e]:offsets[e + 1]] for e in active])
            grad_x = dx2d.reshape(ctx.x_shape)
        grad_weights = [None] * experts
        if any(need_wgrad):
            grad_weights = _weight_grads(options, weights, need_wgrad, wgrad_active, dy_qs, x_saved)
        return (grad_x, None, *grad_weights, *(grad_biases if options.has_bias else ()))


def _weight_grads(options: GroupedOptions, weights, need_wgrad, wgrad_active, dy_qs, x_saved) -> list:
    """What backward returns for each weight: computed now, or (delay_wgrad) queued as one step for all experts."""
    delayed = options.wgrad_store is not None

    def grouped() -> dict:
        """expert -> its weight gradient (or its main_grad, accumulated into) from one grouped call, for the leading
        experts it took; the experts must all accumulate into main_grad or all not (else none are taken)."""
        if not (options.grouped_gemm and wgrad_active):
            return {}
        targets = [main_grad_target(weights[e], options.accumulate_into_main_grad) for e in wgrad_active]
        accumulate = targets[0] is not None
        if any((t is not None) != accumulate for t in targets):
            return {}
        outs = targets if accumulate else [torch.empty(weights[e].shape, dtype=weights[e].dtype,
                                                       device=weights[e].device) for e in wgrad_active]
        if accumulate:
            for e in wgrad_active:
                wait_for_main_grad(weights[e])
        done = hot_path.grouped_gemm([dy_qs[e].columnwise_only() for e in wgrad_active], "columnwise",
                                     [x_saved[e] for e in wgrad_active], "columnwise", outs,
                                     recipe=options.recipe, accumulate=accumulate)
        return dict(zip(wgrad_active[:done], outs[:done]))

    def computes() -> dict:
        """expert -> compute(accumulate_into) of its weight gradient (docs of linear.deliver_weight_grad)."""
        found = {}
        products = grouped()
        for e, weight in enumerate(weights):
            if not need_wgrad[e]:
                continue
            if e not in wgrad_active:  # no tokens: a zero gradient, as nv.Linear gives for an empty batch
                found[e] = (lambda acc, w=weight: acc if acc is not None
                            else torch.zeros(w.shape, dtype=w.dtype, device=w.device))
            elif e in products:  # computed (or accumulated into acc, which is that main_grad) by the grouped call
                found[e] = (lambda acc, p=products[e]: p)
            else:
                found[e] = (lambda acc, e=e, w=weight: hot_path.gemm(
                    dy_qs[e].columnwise_only(), x_saved[e], a_copy="columnwise", b_copy="columnwise",
                    out_dtype=w.dtype, accumulate_into=acc, recipe=options.recipe))
        return found

    def deliver(now_delayed: bool) -> list:
        grads = [None] * len(weights)
        for e, compute in computes().items():
            grads[e] = deliver_weight_grad(weights[e], compute, options.accumulate_into_main_grad, now_delayed)
        return grads

    if delayed:
        options.wgrad_store.append(lambda: deliver(True))
        return [None] * len(weights)
    return deliver(False)


# ---------------------------------------------------------------------------------------------------------------
# The weights' grouped quantization into the per-expert caches.

def _weights_groupable(weights: list, recipe: NVFP4Recipe) -> bool:
    """Whether the experts' weights can be quantized as one stacked tensor by the grouped kernels."""
    first = weights[0]
    return (all(w.is_cuda and w.device == first.device and w.dtype == first.dtype for w in weights)
            and segmented_kernels_apply(first, "weight", recipe))


def _cache_is_current(cache: WeightCache, weight: torch.Tensor, recipe: NVFP4Recipe) -> bool:
    """Whether cache.get(weight, recipe) would return its copy without quantizing (WeightCache's own test)."""
    return cache.key is not None and cache._current(weight, (weight_signature(weight), recipe, True))


def _fill_cache(cache: WeightCache, weight: torch.Tensor, recipe: NVFP4Recipe, quantized: NVFP4Tensor) -> None:
    """Store weight's copies (rowwise and columnwise, quantized elsewhere) in its cache, as WeightCache.get does
    after quantizing."""
    cache.invalidate()
    cache.quantized = quantized
    cache.key = (weight_signature(weight), recipe, True)
    cache.weight_ref, cache.storage_ref = weakref.ref(weight), weakref.ref(weight.untyped_storage())
    if not weight.is_cuda or environment.VERIFY_WEIGHT_CACHE.read():
        cache.values = weight.detach().clone()
    cache.quantizations += 1


# ---------------------------------------------------------------------------------------------------------------
# The module.

class GroupedLinear(torch.nn.Module):
    """E linear layers (experts) of the same shape run over one token tensor split by expert, all GEMMs in NVFP4.

    forward(x [..., in_features], split_sizes) -> [..., out_features]: the token rows (leading dims flattened) of
    expert e are the split_sizes[e] rows after those of experts 0..e-1 (split_sizes: E ints >= 0 summing to the
    token count, or a 1D integer tensor such as Megatron's tokens_per_expert). Bit-identical to a loop of
    per-expert nvfp4_dist.Linear layers (module docstring: stochastic-rounding seeds, grouped GEMMs).

    Parameters weight0 .. weight{E-1} [out, in] and bias0 .. bias{E-1} (Transformer Engine's GroupedLinear names),
    initialised like E torch.nn.Linear layers built in expert order. Other arguments as nvfp4_dist.Linear:
    recipe (NVFP4Recipe, RecipeMap matched against layer_name, or None: autocast / environment), bf16_fallback,
    accumulate_into_main_grad, delay_wgrad (backward_dw() runs every expert's wgrad later). grouped_gemm: one
    grouped GEMM per stage on the Hopper emulation (within the GEMM tolerance of the loop); False: one gemm()
    per expert (bit-identical on every backend). forward's rowwise_input: an NVFP4Tensor holding the rowwise copy
    of x's rows that fprop takes instead of quantizing x (the tokens of an NVFP4 MoE dispatch, one amax per token;
    the wgrad copy is still quantized from x, docs/numerics.md §13). skip_bias_add: forward returns (output without the biases,
    [bias0, ...]) for the caller to add (Megatron's MoE experts scale them by the routing probability).
    Training with recipe.backward_mode "default" needs every split size to be a multiple of 16 (the wgrad copies
    are blocked along tokens); pad each expert's tokens (parallel/megatron/moe.py does). The other backward
    modes are refused.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, recipe: NVFP4Recipe | RecipeMap | None = None, bf16_fallback: bool = False,
                 accumulate_into_main_grad: bool = False, delay_wgrad: bool = False, grouped_gemm: bool = True,
                 skip_bias_add: bool = False):
        super().__init__()
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r}: must be an int >= 1")
        if not bf16_fallback:
            check_features("in_features", in_features)
            check_features("out_features", out_features)
            check_parameter_dtype(dtype)
        check_layer_recipe(recipe)
        ops.check_flag(grouped_gemm, "grouped_gemm")
        ops.check_flag(skip_bias_add, "skip_bias_add")
        self.skip_bias_add = skip_bias_add
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.recipe, self.bf16_fallback, self.grouped_gemm = recipe, bf16_fallback, grouped_gemm
        self.accumulate_into_main_grad, self.delay_wgrad = accumulate_into_main_grad, delay_wgrad
        self.layer_name: str | None = None
        self.last_recipe: NVFP4Recipe | None = None
        self.use_bias = bias
        factory = dict(device=device, dtype=dtype)
        for e in range(num_experts):
            self.register_parameter(f"weight{e}", WeightParameter(torch.empty((out_features, in_features), **factory)))
            self.register_parameter(f"bias{e}", torch.nn.Parameter(torch.empty(out_features, **factory))
                                    if bias else None)
        self.weight_caches = [WeightCache() for _ in range(num_experts)]
        self.wgrad_store: list = []
        self.reset_parameters()

    def weights(self) -> list:
        return [getattr(self, f"weight{e}") for e in range(self.num_experts)]

    def biases(self) -> list:
        return [getattr(self, f"bias{e}") for e in range(self.num_experts)]

    def reset_parameters(self) -> None:
        """torch.nn.Linear's initialisation of each expert in order (same RNG draws as E nn.Linear layers)."""
        for weight, bias in zip(self.weights(), self.biases()):
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            if bias is not None:
                bound = 1 / math.sqrt(self.in_features)
                torch.nn.init.uniform_(bias, -bound, bound)

    def invalidate_weight_cache(self) -> None:
        """Force requantizing every expert's weight at the next forward (after writes through weight.data)."""
        for cache in self.weight_caches:
            cache.invalidate()

    def describe(self) -> str:
        if self.layer_name:
            return self.layer_name
        return (f"GroupedLinear(num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features})")

    def resolved_recipe(self) -> NVFP4Recipe | None:
        """The recipe a forward now runs with (as nvfp4_dist.Linear); None: the BF16 fallback."""
        if self.bf16_fallback or not nvfp4_enabled():
            return None
        return resolve_layer_recipe(self.recipe, self.layer_name, self.describe())

    def forward(self, x: torch.Tensor, split_sizes, rowwise_input: NVFP4Tensor | None = None):
        if self.skip_bias_add:
            return self._forward(x, split_sizes, False, rowwise_input), self.biases()
        return self._forward(x, split_sizes, self.use_bias, rowwise_input)

    def _forward(self, x: torch.Tensor, split_sizes, add_bias: bool, rowwise_input) -> torch.Tensor:
        weights = self.weights()
        biases = self.biases() if add_bias else [None] * self.num_experts
        recipe = self.resolved_recipe()
        if recipe is not None:
            for weight in weights:
                check_weight_dtype(weight)
        check_activation(x, self.in_features, weights[0])
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        sizes = check_split_sizes(split_sizes, self.num_experts, rows)
        store = self.wgrad_store if self.delay_wgrad else None
        self.last_recipe = recipe if x.numel() else None
        if self.last_recipe is None:
            return self._bf16_forward(x, sizes, biases, store)
        if rowwise_input is not None and (not isinstance(rowwise_input, NVFP4Tensor) or not rowwise_input.has_rowwise
                                          or tuple(rowwise_input.shape) != (rows, self.in_features)):
            raise ValueError(f"rowwise_input={rowwise_input!r}: expected an NVFP4Tensor with a rowwise copy of shape "
                             f"{(rows, self.in_features)} (the input's token rows)")
        if recipe.backward_mode != "default":
            raise ValueError(f"recipe.backward_mode={recipe.backward_mode!r}: GroupedLinear runs the NVFP4 backward "
                             f"only; allowed: 'default'")
        training = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
        if training:
            for e, size in enumerate(sizes):
                if size % BLOCK_SIZE:
                    raise ValueError(f"split_sizes[{e}]={size}: training needs each expert's token count to be a "
                                     f"multiple of {BLOCK_SIZE} for the wgrad copies; pad each expert's tokens or "
                                     f"run under torch.no_grad()")
        weight_qs = self._weight_qs(weights, sizes, recipe)
        options = GroupedOptions(recipe=recipe, split_sizes=sizes, weight_qs=weight_qs, num_experts=self.num_experts,
                                 has_bias=add_bias, grouped_gemm=self.grouped_gemm,
                                 accumulate_into_main_grad=self.accumulate_into_main_grad, wgrad_store=store,
                                 grad_enabled=torch.is_grad_enabled(), layer_name=self.describe(),
                                 rowwise_input=rowwise_input)
        params = weights + (biases if add_bias else [])
        return GroupedLinearFunction.apply(x, options, *params)

    def _weight_qs(self, weights: list, sizes: list, recipe: NVFP4Recipe) -> list:
        """Per expert with tokens, its weight's NVFP4Tensor from its WeightCache (None for the others). Where
        several of those caches are stale and the kernels' grouped quantization applies, their weights are
        quantized together (one concatenation, one grouped quantization: grouped_quantize.py) into the caches,
        the same bytes as each cache's own quantization."""
        active = [e for e, size in enumerate(sizes) if size]
        if len(active) > 1 and _weights_groupable([weights[e] for e in active], recipe):
            stale = [e for e in active if not _cache_is_current(self.weight_caches[e], weights[e], recipe)]
            if len(stale) > 1:
                stacked = torch.cat([weights[e].detach() for e in stale])
                parts = quantize_segments(stacked, [self.out_features] * len(stale), "weight", recipe,
                                          contiguous_columnwise=True)
                for e, q in zip(stale, parts):
                    _fill_cache(self.weight_caches[e], weights[e], recipe, q)
        return [self.weight_caches[e].get(weights[e], recipe) if size else None for e, size in enumerate(sizes)]

    def _bf16_forward(self, x: torch.Tensor, sizes: list, biases: list, store) -> torch.Tensor:
        """Each expert's rows through the unquantized linear (the BF16 fallback), concatenated."""
        x2d = x.reshape(-1, x.shape[-1])
        pieces = torch.split(x2d, sizes)
        outputs = [bf16_linear(piece, weight, bias, accumulate_into_main_grad=self.accumulate_into_main_grad,
                               wgrad_store=store)
                   for piece, weight, bias in zip(pieces, self.weights(), biases)]
        return torch.cat(outputs).reshape(*x.shape[:-1], self.out_features)

    def backward_dw(self) -> None:
        """Run the wgrad GEMMs that backward deferred (delay_wgrad=True), oldest first."""
        while self.wgrad_store:
            self.wgrad_store.pop(0)()

    def extra_repr(self) -> str:
        mode = "bf16_fallback" if self.bf16_fallback else "nvfp4"
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, {mode}")
