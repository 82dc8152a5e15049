"""The fused-producer kernels (csrc/norm_quantize.cu, csrc/activation_quantize.cu) on one GPU, byte for byte:

- each kernel against its reference twin (nvfp4_dist/reference/fused_producers.py, run on the CPU): norm and
  activation outputs, norm statistics, amaxes, and the NVFP4 copies;
- the activation of every BF16 input looked up in the kernels' tables against the formulas;
- the fused chain (pass 1, pass 2: the BF16 output never written) against the unfused chain on the GPU (the
  norm's / activation's BF16 output written by its kernel, then the quantize kernels), at hidden 4096 and 8192
  and ffn 14336: both copies with the RHT, per-row amaxes (row-scaled), RMSNorm and LayerNorm, SwiGLU and GELU;
- LayerNormLinear / LayerNormMLP fused against unfused (outputs and every gradient);
- the norm's backward (torch's kernels from our statistics) against torch's own norms.

    python -m pytest -q tests_multigpu/test_fused_producers_gpu.py
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dist as nv
from nvfp4_dist import fused, fused_kernels, ops
from nvfp4_dist._extension import load_extension
from nvfp4_dist.layernorm_linear import LayerNormLinear, LayerNormMLP
from nvfp4_dist.reference import fused_producers as R


@pytest.fixture(autouse=True)
def _gpu(cuda_device):
    """Every test here needs the GPU; outputs land in memory dirtied beforehand (unwritten bytes show)."""
    garbage = torch.full((64 << 20,), 0x77, dtype=torch.uint8, device=cuda_device)
    del garbage
    yield


RECIPES = {
    "rht": nv.NVFP4Recipe(),
    "rht_plain_sign": nv.NVFP4Recipe(rht_random_sign=False),
    "no_rht": nv.NVFP4Recipe(rht=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False),
}


def activation_input(shape, dtype=torch.bfloat16, seed=0, offset=0.0, device="cuda"):
    """Normal values with per-row scales over several octaves, a few large outliers, and an offset."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rows, cols = shape
    x = torch.randn(rows, cols, generator=generator, device=device)
    x = x * torch.exp2(torch.randint(-5, 6, (rows, 1), generator=generator, device=device).float()) + offset
    x[::97, ::31] *= 40.0
    return x.to(dtype)


def norm_parameters(hidden, normalization, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (1 + 0.3 * torch.randn(hidden, generator=generator, device="cuda")).bfloat16()
    bias = 0.2 * torch.randn(hidden, generator=generator, device="cuda")
    bias = bias.bfloat16() if normalization == "LayerNorm" else None
    return weight, bias


def to_cpu(t):
    return None if t is None else t.cpu()


def assert_bits(got, want, name):
    if want is None:
        assert got is None, name
        return
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    differ = got.view(raw) != want.view(raw)
    assert not differ.any(), (f"{name}: {int(differ.sum())} of {got.numel()} differ, "
                              f"first at {differ.nonzero()[:3].tolist()}")


def assert_same_copies(q, r):
    for name in ("rowwise_data", "rowwise_scale", "amax_rowwise", "columnwise_data", "columnwise_scale",
                 "amax_columnwise"):
        assert_bits(getattr(q, name), getattr(r, name), name)
    assert (tuple(q.shape), q.dtype, q.rht, q.rht_random_sign, q.row_scaled) == \
        (tuple(r.shape), r.dtype, r.rht, r.rht_random_sign, r.row_scaled)


def assert_activation_passes_match_reference(h, activation, options):
    """Both fused activation passes on the GPU (amaxes, then the cast) against the reference on the CPU."""
    got = fused_kernels.activation_amaxes(h, activation=activation, **options)
    want = R.activation_amaxes(h.cpu(), activation=activation, **options)
    for name, g, w in zip(("amax_rowwise", "amax_columnwise"), got, want):
        assert_bits(g, w, name)
    quantize = dict(amax_rowwise=got[0], amax_columnwise=got[1], **options)
    q = fused_kernels.activation_quantize(h, activation=activation, **quantize)
    r = R.activation_quantize(h.cpu(), activation=activation,
                              **{k: to_cpu(v) if isinstance(v, torch.Tensor) else v for k, v in quantize.items()})
    assert_same_copies(q, r)


def cast_options(recipe, columnwise=True):
    options = ops.quantize_options("activation", recipe)
    return dict(columnwise=columnwise and not options["row_scaled"], rht=options["rht"],
                rht_random_sign=options["rht_random_sign"], row_scaled=options["row_scaled"])


# ------------------------------------------------------------------------------------------------------------
# Kernels against their reference twins (reference on the CPU)

NORM_SHAPES = [(256, 4096), (272, 8192), (64, 16384), (96, 272), (112, 5120), (50, 4112)]


@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_norm_statistics_by_stage(shape, dtype, normalization):
    """The row pass's statistics stage by stage, so that a difference names its stage: the mean (LayerNorm), the
    sum of squares before rstd, then rstd from the kernel's own sum of squares (the square root and divisions)."""
    x = activation_input(shape, dtype, seed=shape[1], offset=0.75)
    x[3] = 0.0
    x[5] = -0.0  # sums to -0 where the tree has no padding: the mean is +0 all the same
    mean, sum_of_squares = fused_kernels.norm_row_sums(x, normalization=normalization)
    mean_ref, sum_of_squares_ref = R.norm_row_sums(x.cpu(), normalization=normalization)
    assert_bits(mean, mean_ref, "mean")
    assert_bits(sum_of_squares, sum_of_squares_ref, "sum of squares")
    weight = torch.ones(shape[1], device="cuda")
    bias = torch.zeros_like(weight) if normalization == "LayerNorm" else None
    _, _, rstd = fused_kernels.norm_forward(x, weight, bias, normalization=normalization, eps=1e-5,
                                            out_dtype=torch.float32)
    assert_bits(rstd, R.rstd_of(sum_of_squares.cpu(), shape[1], 1e-5), "rstd of the kernel's sum of squares")


@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.float16), (torch.float32, torch.float32)], ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_norm_forward_matches_reference(shape, dtype, out_dtype, normalization):
    x = activation_input(shape, dtype, seed=shape[1], offset=0.75)
    x[3] = 0.0  # a zero row: rstd = 1 / sqrt(eps)
    weight, bias = norm_parameters(shape[1], normalization)
    args = (weight.float(), None if bias is None else bias.float())
    y, mean, rstd = fused_kernels.norm_forward(x, *args, normalization=normalization, eps=1e-5, out_dtype=out_dtype)
    y_ref, mean_ref, rstd_ref = R.norm_forward(x.cpu(), *map(to_cpu, args), normalization=normalization, eps=1e-5,
                                               out_dtype=out_dtype)
    assert_bits(rstd, rstd_ref, "rstd")
    assert_bits(mean, mean_ref, "mean")
    assert_bits(y, y_ref, "y")


@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_norm_row_pass_over_several_bands_per_cta(dtype, normalization):
    """Twice as many 16-row bands as the row pass has CTAs (8 a multiprocessor) and a last band of 3 rows: each
    CTA's copy pipeline crosses from band to band, and the last row group is partial."""
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    shape = (16 * 8 * multiprocessors * 2 + 35, 272)
    x = activation_input(shape, dtype, seed=5, offset=0.25)
    weight, bias = norm_parameters(shape[1], normalization)
    args = (weight.float(), None if bias is None else bias.float())
    y, mean, rstd = fused_kernels.norm_forward(x, *args, normalization=normalization, eps=1e-5,
                                               out_dtype=torch.bfloat16)
    y_ref, mean_ref, rstd_ref = R.norm_forward(x.cpu(), *map(to_cpu, args), normalization=normalization, eps=1e-5,
                                               out_dtype=torch.bfloat16)
    assert_bits(rstd, rstd_ref, "rstd")
    assert_bits(mean, mean_ref, "mean")
    assert_bits(y, y_ref, "y")


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("shape", [(256, 4096), (128, 8192), (160, 2192), (64, 16384)], ids=str)
def test_norm_passes_match_reference(shape, normalization, recipe_name):
    options = cast_options(RECIPES[recipe_name])
    x = activation_input(shape, seed=7, offset=-0.5)
    weight, bias = norm_parameters(shape[1], normalization, seed=2)
    args = (weight.float(), None if bias is None else bias.float())
    got = fused_kernels.norm_amaxes(x, *args, normalization=normalization, eps=1e-6, **options)
    want = R.norm_amaxes(x.cpu(), *map(to_cpu, args), normalization=normalization, eps=1e-6, **options)
    for name, g, w in zip(("mean", "rstd", "amax_rowwise", "amax_columnwise"), got, want):
        assert_bits(g, w, name)
    mean, rstd, amax_rowwise, amax_columnwise = got
    quantize = dict(amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise, **options)
    q = fused_kernels.norm_quantize(x, *args, mean, rstd, **quantize)
    r = R.norm_quantize(x.cpu(), *map(to_cpu, args), to_cpu(mean), rstd.cpu(),
                        **{k: to_cpu(v) if isinstance(v, torch.Tensor) else v for k, v in quantize.items()})
    assert_same_copies(q, r)


ACTIVATION_SHAPES = [(256, 4096), (128, 14336), (48, 2192)]


@pytest.mark.parametrize("activation", R.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", ACTIVATION_SHAPES, ids=str)
def test_activation_forward_matches_reference(shape, dtype, activation):
    rows, cols = shape
    h = activation_input((rows, cols * (2 if activation == "swiglu" else 1)), dtype, seed=cols)
    h[0, :16] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e-20, -1e-20, 5.0, -5.0, 0.5, -0.5, 8.0, -8.0,
                              1.0, -1.0]).to(dtype)
    got = fused_kernels.activation_forward(h, activation=activation, out_dtype=dtype)
    assert_bits(got, R.activation_forward(h.cpu(), activation=activation, out_dtype=dtype), "activation")


def every_bf16_input(activation):
    """h whose (gate) values are all 2^16 BF16 bit patterns, infinities and NaNs included; SwiGLU's up half
    normal values of several octaves."""
    x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(4096, 16)
    if activation == "swiglu":
        x = torch.cat([x, activation_input((4096, 16), device="cpu", seed=5)], dim=1)
    return x.cuda()


def assert_bits_nan_as_nan(got, want, name):
    """assert_bits, a NaN matching any NaN (the formulas' NaN payloads are not specified)."""
    got, want = got.cpu().float(), want.cpu().float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{name}: NaNs differ"
    assert_bits(got[~nan], want[~nan], name)


@pytest.mark.parametrize("activation", R.ACTIVATIONS)
def test_activation_tables_equal_the_formulas_on_every_bf16_input(activation):
    """The kernels look the activation of BF16 inputs up (fused_kernels.activation_table); on all 2^16 inputs the
    lookup equals the reference and the kernels' formula path (table None, as under CUDA graph capture)."""
    h = every_bf16_input(activation)
    looked_up = fused_kernels.activation_forward(h, activation=activation, out_dtype=torch.bfloat16)
    by_formula = torch.empty_like(looked_up)
    code = 0 if activation == "gelu" else 1
    load_extension().activation_forward(h, code, by_formula, None, torch.cuda.current_stream().cuda_stream)
    want = R.activation_forward(h.cpu(), activation=activation, out_dtype=torch.bfloat16)
    assert_bits_nan_as_nan(looked_up, want, "looked up")
    assert_bits_nan_as_nan(by_formula, want, "formula")


@pytest.mark.parametrize("activation", R.ACTIVATIONS)
def test_fused_activation_captured_in_a_cuda_graph_before_its_table_exists(activation, monkeypatch):
    """Captured before the device has the activation's table, the fused cast runs the formulas (no table is built
    during capture) and gives the same copies as the eager cast, which builds and uses the table."""
    monkeypatch.setattr(fused_kernels, "_ACTIVATION_TABLES", {})
    recipe = dataclasses.replace(RECIPES["rht"], check_finite=False)  # its deferred host check does not capture
    h = activation_input((256, 2048 * (2 if activation == "swiglu" else 1)), seed=13)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused.quantize_activation_output(h, activation=activation, recipe=recipe, columnwise=True)
    assert fused_kernels._ACTIVATION_TABLES == {}, "a table was built during capture"
    graph.replay()
    torch.cuda.synchronize()
    eager = fused.quantize_activation_output(h, activation=activation, recipe=recipe, columnwise=True)
    assert (h.device, activation) in fused_kernels._ACTIVATION_TABLES
    assert_same_copies(captured, eager)


@pytest.mark.parametrize("recipe_name", ["rht", "row_scaled"])
@pytest.mark.parametrize("activation", R.ACTIVATIONS)
def test_activation_passes_by_table_equal_passes_by_formula(activation, recipe_name):
    """Both fused passes give the same amaxes and copies with the table as with the formulas."""
    options = cast_options(RECIPES[recipe_name])
    h = activation_input((512, 4096 * (2 if activation == "swiglu" else 1)), seed=9, offset=-0.25)
    code, stream = 0 if activation == "gelu" else 1, torch.cuda.current_stream().cuda_stream
    extension, table = load_extension(), fused_kernels.activation_table(h.device, activation)
    results = []
    for given in (table, None):
        rows = h.shape[0]
        amax_rowwise = torch.empty(rows if options["row_scaled"] else 1, device="cuda")
        amax_rht = torch.empty(1, device="cuda") if options["rht"] else None
        extension.activation_amaxes(h, code, amax_rowwise, options["row_scaled"], amax_rht,
                                    options["rht_random_sign"], given, stream)
        amax_columnwise = amax_rht if options["columnwise"] else None
        cols = 4096
        q = [torch.full((rows, cols // 2), 0x77, dtype=torch.uint8, device="cuda"),
             torch.full((rows, cols // 16), 0x77, dtype=torch.uint8, device="cuda")]
        q += [torch.full((cols, rows // 2), 0x77, dtype=torch.uint8, device="cuda"),
              torch.full((cols, rows // 16), 0x77, dtype=torch.uint8, device="cuda")] if options["columnwise"] else [None, None]
        extension.activation_cast(h, code, amax_rowwise, amax_columnwise, *q, options["row_scaled"], options["rht"],
                                  options["rht_random_sign"], given, stream)
        results.append([amax_rowwise, amax_rht, *q])
    for name, by_table, by_formula in zip(("amax_rowwise", "amax_rht", "rowwise_data", "rowwise_scale",
                                           "columnwise_data", "columnwise_scale"), *results):
        assert_bits(by_table, by_formula, name)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("activation", R.ACTIVATIONS)
@pytest.mark.parametrize("shape", ACTIVATION_SHAPES, ids=str)
def test_activation_passes_match_reference(shape, activation, recipe_name):
    options = cast_options(RECIPES[recipe_name])
    rows, cols = shape
    h = activation_input((rows, cols * (2 if activation == "swiglu" else 1)), seed=rows + cols)
    assert_activation_passes_match_reference(h, activation, options)


@pytest.mark.parametrize("recipe_name", ["rht", "row_scaled"])
@pytest.mark.parametrize("activation", R.ACTIVATIONS)
def test_activation_passes_on_values_outside_the_tables(activation, recipe_name):
    """The kernels look two BF16 values a word up and redo a group on the exact path where a value lies outside the
    tables' common range: zeros and -0.0, BF16 subnormals, values below and far above the tables, of both signs,
    scattered and in whole rows. Both passes against the reference."""
    options = cast_options(RECIPES[recipe_name])
    h = activation_input((256, 2048 * (2 if activation == "swiglu" else 1)), seed=31).float()
    generator = torch.Generator(device="cuda").manual_seed(32)
    special = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 2e-8, -2e-8, 1e-3, -1e-3, 300.0, -300.0, 5e4, -5e4],
                           device="cuda")
    picks = torch.randint(0, special.numel(), h.shape, generator=generator, device="cuda")
    scattered = torch.rand(h.shape, generator=generator, device="cuda") < 0.02
    h = torch.where(scattered, special[picks], h)
    h[5] = 0.0
    h[6, ::2] = -0.0
    h = h.bfloat16()
    assert_activation_passes_match_reference(h, activation, options)


@pytest.mark.parametrize("recipe_name", ["rht", "row_scaled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_swiglu_cast_of_many_partial_tiles_per_cta(dtype, recipe_name):
    """More 64 x 128 tiles than CTAs, partial ones among them (1040 x 4112: the last row of tiles has 16 rows, the
    last column of tiles 16 columns): each CTA's copy pipeline alternates its two source slots over whole and
    partial tiles. Against the reference."""
    options = cast_options(RECIPES[recipe_name])
    h = activation_input((1040, 2 * 4112), dtype, seed=21, offset=0.125)
    assert_activation_passes_match_reference(h, "swiglu", options)


def test_rowwise_only_casts_of_any_row_count():
    """No columnwise copy: any row count, tiles with partial rows and columns."""
    x = activation_input((100, 4112), seed=3)
    weight, bias = norm_parameters(4112, "LayerNorm")
    for recipe in (RECIPES["rht"], RECIPES["row_scaled"]):
        q, _, _ = fused.quantize_norm_output(x, weight, bias, normalization="LayerNorm", eps=1e-5, recipe=recipe,
                                             columnwise=False)
        y = fused.norm(x, weight, bias, normalization="LayerNorm")
        assert_same_copies(q, ops.quantize(y, recipe=recipe, columnwise=False))


# ------------------------------------------------------------------------------------------------------------
# The fused chain against the unfused chain, on the GPU, at model sizes

CHAIN_RECIPES = ["rht", "row_scaled"]


@pytest.mark.parametrize("recipe_name", CHAIN_RECIPES)
@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("tokens,hidden", [(8192, 4096), (8192, 8192)], ids=str)
def test_fused_norm_chain_equals_unfused_chain(tokens, hidden, normalization, recipe_name):
    recipe = RECIPES[recipe_name]
    columnwise = not recipe.row_scaled_activation
    x = activation_input((tokens, hidden), seed=hidden, offset=0.25)
    weight, bias = norm_parameters(hidden, normalization, seed=hidden)
    fused_q, mean, rstd = fused.quantize_norm_output(x, weight, bias, normalization=normalization, eps=1e-5,
                                                     recipe=recipe, columnwise=columnwise)
    y = fused.norm(x, weight, bias, normalization=normalization)
    assert y.dtype == torch.bfloat16
    assert_same_copies(fused_q, ops.quantize(y, "activation", recipe=recipe, columnwise=columnwise))
    _, mean_alone, rstd_alone = fused_kernels.norm_forward(x, weight.float(), None if bias is None else bias.float(),
                                                           normalization=normalization, eps=1e-5,
                                                           out_dtype=torch.bfloat16)
    assert_bits(rstd, rstd_alone, "rstd")
    assert_bits(mean, mean_alone, "mean")


@pytest.mark.parametrize("recipe_name", CHAIN_RECIPES)
@pytest.mark.parametrize("activation", R.ACTIVATIONS)
@pytest.mark.parametrize("tokens,ffn", [(8192, 14336), (4096, 28672)], ids=str)
def test_fused_activation_chain_equals_unfused_chain(tokens, ffn, activation, recipe_name):
    recipe = RECIPES[recipe_name]
    columnwise = not recipe.row_scaled_activation
    h = activation_input((tokens, ffn * (2 if activation == "swiglu" else 1)), seed=ffn)
    fused_q = fused.quantize_activation_output(h, activation=activation, recipe=recipe, columnwise=columnwise)
    a = fused.activation(h, activation=activation)
    assert_same_copies(fused_q, ops.quantize(a, "activation", recipe=recipe, columnwise=columnwise))


def test_fused_chain_equals_cpu_reference_chain():
    """The whole chain against the reference on the CPU (norm, then quantize), once at hidden 4096."""
    x = activation_input((1024, 4096), seed=11, offset=1.0)
    weight, bias = norm_parameters(4096, "RMSNorm", seed=5)
    q, _, _ = fused.quantize_norm_output(x, weight, bias, normalization="RMSNorm", eps=1e-5, recipe=RECIPES["rht"],
                                         columnwise=True)
    y, _, _ = R.norm_forward(x.cpu(), weight.cpu(), None, normalization="RMSNorm", eps=1e-5, out_dtype=torch.bfloat16)
    assert_same_copies(q, nv.reference.quantize_tensor(y, rht=True))


# ------------------------------------------------------------------------------------------------------------
# Layers and gradients

def run(module, x, dy, seed=3):
    x = x.clone().requires_grad_(True)
    y = module(x)
    torch.manual_seed(seed)
    y.backward(dy)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def assert_runs_equal(a, b):
    assert_bits(a[0], b[0], "output")
    assert_bits(a[1], b[1], "input gradient")
    for name in a[2]:
        assert_bits(a[2][name], b[2][name], name)


@pytest.mark.parametrize("recipe_name", ["rht", "row_scaled"])
@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
def test_layernorm_linear_fused_equals_unfused(normalization, recipe_name):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    layer = LayerNormLinear(4096, 1024, normalization=normalization, recipe=recipe, device="cuda")
    with torch.no_grad():
        layer.layer_norm_weight.normal_(1.0, 0.2)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.normal_(0.0, 0.1)
    x = activation_input((2048, 4096), seed=13).reshape(1024, 2, 4096)
    dy = activation_input((2048, 1024), seed=17).reshape(1024, 2, 1024)
    fused_run = run(layer, x, dy)
    layer.recipe = recipe.replace(fused_producers=False)
    assert_runs_equal(fused_run, run(layer, x, dy))


@pytest.mark.parametrize("activation", R.ACTIVATIONS)
def test_layernorm_mlp_fused_equals_unfused(activation):
    torch.manual_seed(1)
    mlp = LayerNormMLP(2048, 4096, activation=activation, normalization="RMSNorm", device="cuda")
    x = activation_input((2048, 2048), seed=19)
    dy = activation_input((2048, 2048), seed=23)
    fused_run = run(mlp, x, dy)
    mlp.fc1.recipe = mlp.fc2.recipe = nv.NVFP4Recipe(fused_producers=False)
    assert_runs_equal(fused_run, run(mlp, x, dy))


@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
def test_norm_gradients_close_to_torch(normalization):
    x = activation_input((512, 4096), seed=29, offset=0.5).requires_grad_(True)
    weight, bias = norm_parameters(4096, normalization, seed=6)
    params = [x, weight.requires_grad_(True)] + ([bias.requires_grad_(True)] if bias is not None else [])
    dy = activation_input((512, 4096), seed=31)
    got = torch.autograd.grad(fused.norm(x, weight, bias, normalization=normalization), params, dy)
    if normalization == "LayerNorm":
        expected = F.layer_norm(x, (4096,), weight, bias, 1e-5)
    else:
        expected = F.rms_norm(x, (4096,), weight, 1e-5)
    want = torch.autograd.grad(expected, params, dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())


def test_kernel_backends_are_used():
    """The layers' norm and activation run the kernels on CUDA tensors (not the reference on the GPU)."""
    assert fused._norm_backend(torch.empty(1, 4096, device="cuda")) is fused_kernels
    assert fused._activation_backend(torch.empty(1, 4096, device="cuda")) is fused_kernels
    assert fused._norm_backend(torch.empty(1, 16400, device="cuda")) is R  # wider than the kernels' rows
