"""recipe.backward_mode (docs/numerics.md §10): default | high_precision | dequantized, each against a float64
computation of what the mode means.

The quantized bytes come from the independent oracle (tests/helpers/oracle.py through tests/helpers/emulation.py);
this file decodes them itself in float64 (code table x E4M3 scale x amax / (6 B), B the copy's global-scale
bound: 448, or 256 for some 4over6 copies) and multiplies in float64:
  default         dx = Q(dy)_row . Q(W)_col^T          dW = Q(dy)_col . Q(x)_col^T      (RHT, SR as the recipe)
  high_precision  dx = dy . W                          dW = dy^T . x
  dequantized     dx = dy . D(Q(W)_row)                dW = dy^T . D(Q(x)_row)          (D: to the compute dtype)
fprop is NVFP4 in every mode: y = Q(x)_row . Q(W)_row^T + b.
FP32 activations compare within FP32 accumulation error; BF16 ones within BF16 output rounding. Under tensor
parallelism (gloo, 2 ranks) the expectation is built from the full tensors: weights quantized per shard, inputs
per the layer kind (a sequence-parallel column-parallel input with the group's amax, i.e. as the full tensor).
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import formats
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, collectives
from tests.helpers.distributed import run_distributed
from tests.helpers.emulation import draw_seed_like_backward, quantize_activation, quantize_gradient, quantize_weight

MODES = ("default", "high_precision", "dequantized")
BACKWARD_SEED = 5
TOKENS, IN, OUT = 32, 64, 48
FP32_TOLERANCE = 2e-6   # max error / max |expected|: FP32 sums of <= 64 terms against float64
BF16_TOLERANCE = 1e-2   # BF16 outputs (and BF16 dequantized operands) against float64


def decode(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, bound: int) -> torch.Tensor:
    """float64 values of one NVFP4 copy: FP4 code value x E4M3 block scale x amax / (6 x bound), per row when amax
    is (a row-scaled rowwise copy, or the per-column columnwise copy of a row-scaled activation)."""
    magnitudes = torch.tensor(formats.FP4_MAGNITUDES, dtype=torch.float64, device=data.device)
    table = torch.cat([magnitudes, -magnitudes])
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).long()
    values = table[codes]
    rows, cols = values.shape
    block_scales = scale.to(torch.float64).repeat_interleave(16, dim=1)
    global_scale = amax.to(torch.float64).reshape(-1, 1) / (6.0 * bound)
    return values * block_scales * global_scale


def rowwise(q):
    return decode(q.rowwise_data, q.rowwise_scale, q.amax_rowwise, q.e4m3_bound)


def columnwise(q):
    """The columnwise copy [K, M] as stored (x^T, with the RHT applied along M when the recipe says)."""
    return decode(q.columnwise_data, q.columnwise_scale, q.amax_columnwise, q.e4m3_bound)


def in_dtype(t64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 operand rounded to the compute dtype (the dequantized mode's operands), back in float64."""
    return t64.to(dtype).to(torch.float64)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, what: str, dtype=torch.float32) -> None:
    """got within the rounding of the compute dtype `dtype` of the float64 expectation."""
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    assert got.shape == expected.shape, (what, tuple(got.shape), tuple(expected.shape))
    error = (got.double() - expected).abs().max() / expected.abs().max()
    assert error <= tolerance, f"{what}: max error {float(error):.3g} of max |expected| (allowed {tolerance:g})"


def expected_backward(mode, recipe, x2d, dy2d, weight, dyq=None, sr_seed=None, x_amax=None):
    """(dx, dW) in float64 for one linear y = x W^T with the whole x, dy and W (one device, or one shard's)."""
    dtype = x2d.dtype
    if mode == "high_precision":
        return dy2d.double() @ weight.to(dtype).double(), dy2d.double().t() @ x2d.double()
    if mode == "dequantized":
        xq_row, _ = quantize_activation(x2d, recipe, columnwise=False, amax_rowwise=x_amax)
        wq = quantize_weight(weight, recipe)
        return (dy2d.double() @ in_dtype(rowwise(wq), dtype),
                dy2d.double().t() @ in_dtype(rowwise(xq_row), dtype))
    _, xq_col = quantize_activation(x2d, recipe, rowwise=False, amax_columnwise=x_amax)
    wq = quantize_weight(weight, recipe)
    dyq_row, dyq_col = dyq if dyq is not None else quantize_gradient(dy2d, recipe, sr_seed)
    return rowwise(dyq_row) @ columnwise(wq).t(), columnwise(dyq_col) @ columnwise(xq_col).t()


def expected_fprop(recipe, x2d, weight, x_amax=None):
    xq_row, _ = quantize_activation(x2d, recipe, columnwise=False, amax_rowwise=x_amax)
    return rowwise(xq_row) @ rowwise(quantize_weight(weight, recipe)).t()


def inputs(dtype, tokens=TOKENS, in_features=IN, out_features=OUT):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, in_features, generator=generator).to(dtype)
    dy = torch.randn(tokens, out_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    return x, dy, weight, bias


def saved_for_backward(fn):
    """The tensors autograd saved while fn() ran, and fn's result."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return saved, result


# Recipes whose copies differ from the default ones: row-scaled activations (a per-column amax on x's columnwise
# copy, docs/numerics.md §6b) and 4over6 on weights and activations with the global-scale bound 256 (§12).
VARIANTS = {"plain": {}, "row_scaled": {"row_scaled_activation": True},
            "4over6": {"nvfp4_4over6": "all", "rht": False, "nvfp4_4over6_e4m3_use_256": "all"}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_linear_backward_mode_against_float64(mode, dtype, variant):
    recipe = nv.NVFP4Recipe(backward_mode=mode, **VARIANTS[variant])
    x, dy, weight, bias = inputs(dtype)
    layer = nv.Linear(IN, OUT, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x_in = x.clone().requires_grad_(True)
    saved, y = saved_for_backward(lambda: layer(x_in))
    torch.manual_seed(BACKWARD_SEED)
    y.backward(dy)
    torch.manual_seed(BACKWARD_SEED)
    dx, dw = expected_backward(mode, recipe, x, dy, weight, sr_seed=draw_seed_like_backward())
    assert_matches(y.detach(), expected_fprop(recipe, x, weight) + bias.to(dtype).double(), f"{mode} y", dtype)
    assert_matches(x_in.grad, dx, f"{mode} dx", dtype)
    assert_matches(layer.weight.grad, dw, f"{mode} dW", dtype)
    assert x_in.grad.dtype == dtype and layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(layer.bias.grad, dy.sum(0).float())

    # What forward keeps: x itself only in high_precision; NVFP4 copies otherwise; the weight parameter (no copy)
    # in high_precision, a quantized copy (the rowwise one when dequantized) otherwise.
    keeps_x = any(t.data_ptr() == x_in.data_ptr() for t in saved)
    keeps_weight = any(t is layer.weight for t in saved)
    assert (keeps_x, keeps_weight) == ((True, True) if mode == "high_precision" else (False, False)), mode
    floating = [t for t in saved if t.is_floating_point() and t.numel() >= TOKENS * IN // 2]  # not amaxes, scales
    assert all(t.data_ptr() in (x_in.data_ptr(), layer.weight.data_ptr()) for t in floating), mode
    cached = layer.weight_cache.quantized
    assert cached.has_rowwise and cached.has_columnwise == (mode == "default")


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_unquantized_modes_take_token_counts_that_are_not_multiples_of_16(mode):
    """No columnwise (token-blocked) copies in these modes, so any token count trains."""
    recipe = nv.NVFP4Recipe(backward_mode=mode)
    x, dy, weight, bias = inputs(torch.float32, tokens=20)
    layer = nv.Linear(IN, OUT, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x_in = x.clone().requires_grad_(True)
    layer(x_in).backward(dy)
    dx, dw = expected_backward(mode, recipe, x, dy, weight)
    assert_matches(x_in.grad, dx, f"{mode} dx")
    assert_matches(layer.weight.grad, dw, f"{mode} dW")
    with pytest.raises(ValueError, match="multiple of 16"):
        nv.Linear(IN, OUT, recipe=nv.NVFP4Recipe())(x_in)


def test_backward_mode_environment_and_validation(monkeypatch):
    monkeypatch.setenv("NVFP4_BACKWARD_MODE", "dequantized")
    assert nv.NVFP4Recipe.from_env().backward_mode == "dequantized"
    monkeypatch.setenv("NVFP4_BACKWARD_MODE", "bf16")
    with pytest.raises(ValueError, match="NVFP4_BACKWARD_MODE='bf16'.*high_precision"):
        nv.NVFP4Recipe.from_env()
    with pytest.raises(ValueError, match="backward_mode='fp32'.*one of.*'default', 'high_precision', 'dequantized'"):
        nv.NVFP4Recipe(backward_mode="fp32")


def test_delayed_wgrad_and_main_grad_in_unquantized_modes():
    """Megatron's hooks (main_grad accumulation, delayed wgrad) see the same gradient as the plain backward."""
    for mode in ("high_precision", "dequantized"):
        recipe = nv.NVFP4Recipe(backward_mode=mode)
        x, dy, weight, _ = inputs(torch.float32)
        plain = nv.Linear(IN, OUT, bias=False, recipe=recipe)
        hooked = nv.Linear(IN, OUT, bias=False, recipe=recipe, accumulate_into_main_grad=True, delay_wgrad=True)
        for layer in (plain, hooked):
            with torch.no_grad():
                layer.weight.copy_(weight)
        hooked.weight.main_grad = torch.ones_like(hooked.weight)
        plain(x.clone().requires_grad_(True)).backward(dy)
        hooked(x.clone().requires_grad_(True)).backward(dy)
        assert torch.equal(hooked.weight.main_grad, torch.ones_like(weight))  # delayed: nothing yet
        hooked.backward_dw()
        torch.testing.assert_close(hooked.weight.main_grad, plain.weight.grad + 1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_fused_producers_in_each_backward_mode(mode, monkeypatch):
    """LayerNormMLP fuses its norm and activation into the casts except in high_precision, whose backward keeps
    the producers' outputs themselves; fused or not, the same outputs and gradients."""
    import nvfp4_dist.layernorm_linear as layernorm_linear
    calls = []
    for name in ("quantize_norm_output", "quantize_activation_output"):
        original = getattr(layernorm_linear, name)
        monkeypatch.setattr(layernorm_linear, name,
                            lambda *args, _original=original, _name=name, **kwargs: (calls.append(_name),
                                                                                    _original(*args, **kwargs))[1])
    recipe = nv.NVFP4Recipe(backward_mode=mode, fused_producers=True)
    torch.manual_seed(3)
    mlp = nv.LayerNormMLP(64, 32, activation="swiglu", normalization="RMSNorm", recipe=recipe)
    x, dy, _, _ = inputs(torch.bfloat16, out_features=64)

    def run():
        x_in = x.clone().requires_grad_(True)
        y = mlp(x_in)
        torch.manual_seed(BACKWARD_SEED)
        y.backward(dy)
        grads = [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        return [y.detach(), x_in.grad, *grads]

    fused = run()
    assert len(calls) == (0 if mode == "high_precision" else 2), calls
    assert mlp.fc1.last_recipe == recipe and mlp.fc2.last_recipe == recipe
    mlp.fc1.recipe = mlp.fc2.recipe = recipe.replace(fused_producers=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, run()))


@pytest.mark.parametrize("mode", MODES)
def test_weight_requantized_in_backward_gives_the_same_gradients(mode):
    """A layer that keeps no weight copy between forward and backward (keep_quantized_weight=False, as the
    Megatron adapters outside flagged micro-batches) quantizes again the copy its backward mode needs."""
    x, dy, weight, _ = inputs(torch.float32)
    runs = []
    for keep in (True, False):
        layer = ColumnParallelLinear(IN, OUT, bias=False, recipe=nv.NVFP4Recipe(backward_mode=mode),
                                     init_method=lambda w: w.copy_(weight))
        layer.keep_quantized_weight = keep
        runs.append(run_layer(layer, x, dy))
    assert all(torch.equal(a, b) for a, b in zip(*runs)), mode


# ---------------------------------------------------------------------------------------------------------
# Tensor parallel (gloo, 2 ranks): column- and row-parallel, with and without sequence parallelism and overlap.

SEQ, BATCH = 16, 2   # 32 tokens; 16 per rank under SP
TP = 2


class CollectiveLog:
    """Counts the layer comms' gathers by kind (a BF16 tensor or an NVFP4Tensor) while installed."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("all_gather_bf16", "all_gather_nvfp4"):
            original = getattr(collectives, name)

            def logged(*args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(*args, **kwargs)
            monkeypatch.setattr(collectives, name, logged)

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def run_layer(layer, x_local, dy_local):
    x_in = x_local.clone().requires_grad_(True)
    y, _ = layer(x_in)
    torch.manual_seed(BACKWARD_SEED)
    y.backward(dy_local)
    return y.detach(), x_in.grad, layer.weight.grad


def check_column(rank, mode, sequence_parallel, overlap, keep_input_columnwise, log, variant="plain"):
    recipe = nv.NVFP4Recipe(backward_mode=mode, overlap=overlap, overlap_min_chunk_gflops=0, **VARIANTS[variant])
    out_features = 32
    x, dy, weight, _ = inputs(torch.float32, tokens=SEQ * BATCH, out_features=out_features)
    x3, dy3 = x.reshape(SEQ, BATCH, IN), dy.reshape(SEQ, BATCH, out_features)
    layer = ColumnParallelLinear(IN, out_features, bias=False, sequence_parallel=sequence_parallel, recipe=recipe,
                                 keep_input_columnwise=keep_input_columnwise, init_method=lambda w: w.copy_(weight))
    x_local = x3.chunk(TP)[rank] if sequence_parallel else x3
    log.take()
    y, dx, dw = run_layer(layer, x_local, dy3.chunk(TP, dim=-1)[rank])
    gathers = log.take()

    torch.manual_seed(BACKWARD_SEED)
    sr_seed = draw_seed_like_backward()
    dx_expected = torch.zeros(SEQ * BATCH, IN, dtype=torch.float64)
    for r, (w_r, dy_r) in enumerate(zip(weight.chunk(TP), dy.chunk(TP, dim=-1))):
        dx_r, dw_r = expected_backward(mode, recipe, x, dy_r, w_r, sr_seed=sr_seed)
        dx_expected += dx_r
        if r == rank:
            what = f"column {mode} {variant} sp={sequence_parallel} overlap={overlap} keep={keep_input_columnwise}"
            assert_matches(y.reshape(-1, out_features // TP), expected_fprop(recipe, x, w_r), what + " y")
            assert_matches(dw, dw_r, what + " dW")
    if sequence_parallel:
        dx_expected = dx_expected.reshape(SEQ, BATCH, IN).chunk(TP)[rank].reshape(-1, IN)
    assert_matches(dx.reshape(-1, IN), dx_expected, what + " dx")
    if sequence_parallel and not overlap:
        # What the input's gathers carry: NVFP4 for fprop; for wgrad the NVFP4 columnwise copy (default), the input
        # in its own dtype (high_precision) or the NVFP4 rowwise copy (dequantized).
        wgrad_gather = {"default": "all_gather_nvfp4", "high_precision": "all_gather_bf16",
                        "dequantized": "all_gather_nvfp4"}[mode]
        assert gathers == ["all_gather_nvfp4", wgrad_gather], (what, gathers)


def check_row(rank, mode, sequence_parallel, overlap, log, variant="plain"):
    recipe = nv.NVFP4Recipe(backward_mode=mode, overlap=overlap, overlap_min_chunk_gflops=0, **VARIANTS[variant])
    x, dy, weight, _ = inputs(torch.float32, tokens=SEQ * BATCH, out_features=32)
    layer = RowParallelLinear(IN, 32, bias=False, sequence_parallel=sequence_parallel, recipe=recipe,
                              init_method=lambda w: w.copy_(weight))
    dy3 = dy.reshape(SEQ, BATCH, 32)
    x_local = x.reshape(SEQ, BATCH, IN).chunk(TP, dim=-1)[rank]
    log.take()
    y, dx, dw = run_layer(layer, x_local, dy3.chunk(TP)[rank] if sequence_parallel else dy3)
    gathers = log.take()

    torch.manual_seed(BACKWARD_SEED)
    sr_seed = draw_seed_like_backward()
    dyq = quantize_gradient(dy, recipe, sr_seed)  # the gathered SP gradient equals the full one quantized
    y_expected = torch.zeros(SEQ * BATCH, 32, dtype=torch.float64)
    for r, (x_r, w_r) in enumerate(zip(x.chunk(TP, dim=-1), weight.chunk(TP, dim=-1))):
        y_expected += expected_fprop(recipe, x_r, w_r)
        if r == rank:
            dx_r, dw_r = expected_backward(mode, recipe, x_r, dy, w_r, dyq=dyq)
    what = f"row {mode} {variant} sp={sequence_parallel} overlap={overlap}"
    if sequence_parallel:
        y_expected = y_expected.reshape(SEQ, BATCH, 32).chunk(TP)[rank].reshape(-1, 32)
    assert_matches(y.reshape(-1, 32), y_expected, what + " y")
    assert_matches(dx.reshape(-1, IN // TP), dx_r, what + " dx")
    assert_matches(dw, dw_r, what + " dW")
    if sequence_parallel and not overlap:
        # The output gradient's gathers: NVFP4 copies (default), the gradient itself (unquantized modes).
        expected = (["all_gather_nvfp4", "all_gather_nvfp4"] if mode == "default" else ["all_gather_bf16"])
        assert gathers == expected, (what, gathers)


def _tensor_parallel_worker(rank, world_size):
    monkeypatch = pytest.MonkeyPatch()
    log = CollectiveLog(monkeypatch)
    try:
        for mode in MODES:
            for sequence_parallel, overlap in ((False, False), (True, False), (True, True)):
                check_column(rank, mode, sequence_parallel, overlap, False, log)
                check_row(rank, mode, sequence_parallel, overlap, log)
            check_column(rank, mode, True, False, True, log)
            for variant in ("row_scaled", "4over6"):
                check_column(rank, mode, True, False, False, log, variant)
                check_row(rank, mode, True, False, log, variant)
    finally:
        monkeypatch.undo()


def test_parallel_layers_backward_modes_against_float64():
    run_distributed(_tensor_parallel_worker, TP)
