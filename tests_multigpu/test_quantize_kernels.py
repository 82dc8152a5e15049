"""The CUDA quantization kernels (nvfp4_dist.kernels) against the reference, byte for byte (docs/numerics.md §11).

Codes, unpadded scales and amax must be identical. The reference runs on the GPU (the same torch
ops, correctly rounded, give the same bits as on the CPU; test_gpu_reference_equals_cpu_reference
checks that), except the RHT, whose FP32 matmul runs on the CPU: its summation order is the SPEC's.
"""
import json
import pathlib

import numpy as np
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import kernels, reference
from nvfp4_dist.formats import FP4_MAGNITUDES, fp4_to_float
from nvfp4_dist.reference.fourover6 import FourOverSix
from nvfp4_dist.reference.quantize import decode_scale

# (2192, 11280): wide enough for the banded tile order (csrc/quantize.cu TileOrder), with a partial last
# band, tile row and tile column. (4096, 8208): 65 tile columns in row-major order, so that CTAs of two
# tiles get a partial tile (a row's last) and then a whole one (the next row's first), and the other way
SHAPES = [(128, 128), (256, 272), (304, 304), (1024, 4096), (4096, 4096), (8192, 8192), (2192, 11280),
          (4096, 8208)]
RHT_SHAPES = SHAPES + [(8192, 11328), (16384, 4096)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CONFIGS = {
    "1d": dict(),
    "rowwise_only": dict(columnwise=False),
    "columnwise_only": dict(rowwise=False),
    "2d": dict(block_2d=True),
    "row_scaled": dict(columnwise=False, row_scaled=True),
    "sr": dict(sr_seed=0x1234_5678_9ABC_DEF0, sr_row_offset=48),
    "sr_unaligned_offset": dict(sr_seed=987654321, sr_row_offset=13),
}


@pytest.fixture(autouse=True)
def _gpu(cuda_device):
    """Every test here needs the GPU; outputs land in memory dirtied beforehand (unwritten bytes show)."""
    garbage = torch.full((64 << 20,), 0x77, dtype=torch.uint8, device=cuda_device)
    del garbage
    yield


def random_input(shape, dtype, seed, device="cuda"):
    """Normal values with per-16-block magnitudes spread over many octaves, and a few outliers."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rows, cols = shape
    x = torch.randn(rows, cols, generator=generator, device=device)
    octaves = torch.randint(-6, 7, (rows, cols // 16, 1), generator=generator, device=device).float()
    x = (x.reshape(rows, cols // 16, 16) * torch.exp2(octaves)).reshape(rows, cols)
    return x.to(dtype)


def assert_same(q, r, copies=("rowwise", "columnwise")):
    """Identical codes, scales and amax for each copy present in the reference r."""
    for copy in copies:
        data, ref_data = getattr(q, f"{copy}_data"), getattr(r, f"{copy}_data")
        if ref_data is None:
            assert data is None, f"{copy}: kernel wrote a copy the reference has not"
            continue
        ref_data = ref_data.to(data.device)
        mismatches = (data != ref_data).sum().item()
        assert mismatches == 0, f"{copy} data: {mismatches} of {data.numel()} bytes differ"
        scale = getattr(q, f"{copy}_scale").view(torch.uint8)
        ref_scale = getattr(r, f"{copy}_scale").to(scale.device).view(torch.uint8)
        assert torch.equal(scale, ref_scale), f"{copy} scale: {(scale != ref_scale).sum().item()} differ"
        amax = getattr(q, f"amax_{copy}")
        ref_amax = getattr(r, f"amax_{copy}").to(amax.device)
        assert torch.equal(amax.view(torch.int32), ref_amax.view(torch.int32)), f"amax_{copy}: {amax} vs {ref_amax}"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_matches_reference(shape, dtype, config):
    x = random_input(shape, dtype, seed=shape[0] * 7 + shape[1] + list(CONFIGS).index(config))
    options = CONFIGS[config]
    q = kernels.quantize_tensor(x, **options)
    r = reference.quantize_tensor(x, **options)
    assert_same(q, r)


@pytest.mark.parametrize("sr_row_offset", [None, 32, 13], ids=["rn", "sr", "sr_unaligned_offset"])
@pytest.mark.parametrize("shape", RHT_SHAPES, ids=str)
def test_rht_cast_matches_reference(shape, sr_row_offset):
    """sr_row_offset 13: the columnwise blocks straddle two Philox calls (one call per element)."""
    x = random_input(shape, torch.bfloat16, seed=shape[0] + shape[1])
    options = dict(sr_seed=2024 + shape[0], sr_row_offset=sr_row_offset) if sr_row_offset is not None else {}
    q = kernels.quantize_tensor(x, rht=True, **options)
    assert_same(q, reference.quantize_tensor(x, rht=True, **options))


@pytest.mark.parametrize("random_sign", [True, False])
def test_rht_wide_dynamic_range_matches_cpu_reference(random_sign):
    """Chunks whose exact sums do not fit FP32: the summation order decides, and must be the reference's
    butterflies (reference/rht.py)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4096, 4096, generator=generator) * torch.exp2(torch.randint(-24, 24, (4096, 4096), generator=generator).float())
    x = x.to(torch.bfloat16)
    q = kernels.quantize_tensor(x.cuda(), rht=True, rht_random_sign=random_sign)
    r = reference.quantize_tensor(x, rht=True, rht_random_sign=random_sign)
    assert_same(q, r)


@pytest.mark.parametrize("options", [dict(), dict(sr_seed=21), dict(block_2d=True), dict(block_2d=True, sr_seed=21)],
                         ids=["1d", "1d_sr", "2d", "2d_sr"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_casts_under_two_tensor_scales_match_reference(dtype, options):
    """Both copies under one tensor scale share one e_b table (csrc/quantize.cu shared_table), and the 2D cast
    that rounds to nearest then transposes the rowwise codes into the columnwise copy (transpose_codes); under
    two different amaxes each copy has its own table and codes."""
    x = random_input((1024, 4096), dtype, seed=21)
    amax = x.float().abs().amax().reshape(1)
    for amax_columnwise in (amax * 3, amax.clone(), amax):  # two scales; one value in two tensors; one tensor
        q = kernels.quantize_tensor(x, amax_rowwise=amax, amax_columnwise=amax_columnwise, **options)
        assert_same(q, reference.quantize_tensor(x, amax_rowwise=amax, amax_columnwise=amax_columnwise, **options))


def test_gpu_reference_equals_cpu_reference():
    """The premise of running the reference on the GPU above."""
    x = random_input((1024, 4096), torch.bfloat16, seed=3)
    for options in (dict(), dict(block_2d=True), dict(sr_seed=11, sr_row_offset=5), dict(rht=True),
                    dict(rht=True, sr_seed=11)):
        assert_same(reference.quantize_tensor(x, **options), reference.quantize_tensor(x.cpu(), **options))


@pytest.mark.parametrize("dtype,rht", [(dtype, False) for dtype in DTYPES] + [(torch.bfloat16, True)], ids=str)
def test_compute_amaxes(dtype, rht):
    x = random_input((4096, 4096), dtype, seed=5)
    for row_scaled in (False, True):
        got = kernels.compute_amaxes(x, rht=rht, row_scaled=row_scaled)
        want = reference.compute_amaxes(x, rht=rht, row_scaled=row_scaled)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu().view(torch.int32), w.cpu().view(torch.int32))


def special_inputs(dtype):
    """All-zero, largest finite, subnormal and FP4/E4M3 bin-edge inputs of `dtype`, [256, 256]."""
    info = torch.finfo(dtype)
    rows = cols = 256
    zeros = torch.zeros(rows, cols, dtype=dtype)
    largest = torch.full((rows, cols), info.max, dtype=dtype)
    largest[::3] = -info.max
    largest[1::7, ::5] = 1.0
    subnormal = (torch.randint(-8, 9, (rows, cols)).float() * info.smallest_normal / 16).to(dtype)
    # Global amax 2688 gives S_enc = 1; a block holding 6 then has s_b = 1 and e_b = 1, so each value
    # is its own scaled value: put every FP4 midpoint, its neighbours and -0.0 there.
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0], dtype=torch.float32)
    edges = torch.cat([midpoints, -midpoints, torch.tensor(FP4_MAGNITUDES), -torch.tensor(FP4_MAGNITUDES)])
    bin_edges = edges.repeat(rows * cols // edges.numel()).reshape(rows, cols)
    bin_edges[:, 0::16] = 6.0
    bin_edges[:, 8::32] = -0.0
    bin_edges[0, 1] = 2688.0
    bin_edges[5, 17::16] = 0.1  # blocks with tiny amax: E4M3 scale underflow paths
    return {"zeros": zeros, "largest": largest, "subnormal": subnormal, "bin_edges": bin_edges.to(dtype)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["zeros", "largest", "subnormal", "bin_edges"])
def test_special_inputs(dtype, kind):
    x = special_inputs(dtype)[kind].cuda()
    for options in (dict(), dict(block_2d=True), dict(sr_seed=99), dict(row_scaled=True, columnwise=False)):
        assert_same(kernels.quantize_tensor(x, **options), reference.quantize_tensor(x, **options))
    if dtype == torch.bfloat16:
        assert_same(kernels.quantize_tensor(x, rht=True), reference.quantize_tensor(x, rht=True))


def test_non_contiguous_and_3d_inputs():
    base = random_input((4096, 1024), torch.bfloat16, seed=9)
    transposed = base.t()                       # [1024, 4096], strides (1, 1024)
    sliced = base[:, 256:768]                   # [4096, 512], row stride 1024
    offset = base.reshape(-1)[4:4 + 1024 * 512].reshape(1024, 512)  # contiguous, not 16-byte aligned
    three_d = random_input((2048, 512), torch.float32, seed=4).reshape(16, 128, 512)
    for x in (transposed, sliced, offset, three_d):
        assert_same(kernels.quantize_tensor(x), reference.quantize_tensor(x))
    assert_same(kernels.quantize_tensor(transposed, rht=True, sr_seed=3),
                reference.quantize_tensor(transposed.contiguous(), rht=True, sr_seed=3))


def test_unsupported_inputs_raise_value_error():
    x = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.quantize_tensor(x)  # columnwise copy needs rows % 16 == 0
    assert_same(kernels.quantize_tensor(x, columnwise=False), reference.quantize_tensor(x, columnwise=False))
    with pytest.raises(ValueError, match="last dim"):
        kernels.quantize_tensor(torch.randn(64, 40, device="cuda"))
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.quantize_tensor(torch.randn(64, 64, device="cuda"), rht=True)
    with pytest.raises(ValueError, match="rht"):
        kernels.quantize_tensor(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16), rht=True, block_2d=True)
    with pytest.raises(ValueError, match="dtype"):
        kernels.quantize_tensor(torch.randn(64, 64, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="sr_seed"):
        kernels.quantize_tensor(torch.randn(64, 64, device="cuda"), sr_seed=-1)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.quantize_tensor(torch.randn(64, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ["1d", "2d", "row_scaled", "rht", "rht_plain_sign"])
def test_dequantize_matches_reference(dtype, config):
    x = random_input((1024, 2048), torch.bfloat16 if config.startswith("rht") else dtype, seed=1)
    options = {"1d": {}, "2d": dict(block_2d=True), "row_scaled": dict(row_scaled=True, columnwise=False),
               "rht": dict(rht=True), "rht_plain_sign": dict(rht=True, rht_random_sign=False)}[config]
    q = kernels.quantize_tensor(x, **options)
    q_cpu = q.to("cpu")
    for copy in ("rowwise", "columnwise"):
        if getattr(q, f"{copy}_data") is None:
            continue
        got = kernels.dequantize_tensor(q, dtype, copy)
        want = reference.dequantize_tensor(q_cpu, dtype, copy)   # the CPU reference: the SPEC's sum order
        assert got.shape == x.shape
        got_bits, want_bits = got.cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        assert torch.equal(got_bits, want_bits), f"{copy}: {(got.cpu() != want).sum().item()} values differ"


@pytest.mark.parametrize("shape", [(128, 4), (300, 17), (4096, 256), (1, 1), (8192, 704)], ids=str)
def test_swizzle_scales(shape):
    scale = torch.randint(0, 127, shape, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    got = kernels.swizzle_scales(scale)
    want = reference.swizzle_scales(scale)
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    padded = reference.unswizzle_scales(got, *reference.padded_scale_shape(*shape))
    assert padded.view(torch.uint8)[shape[0]:].eq(0).all() and padded.view(torch.uint8)[:, shape[1]:].eq(0).all()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype,cols", [(torch.uint8, 2048), (torch.float8_e4m3fn, 256), (torch.uint8, 13),
                                        (torch.bfloat16, 6)], ids=str)
def test_swap_first_dims(world_size, dtype, cols):
    gathered = torch.randint(0, 255, (world_size * 384, cols), dtype=torch.uint8, device="cuda")
    gathered = gathered.view(dtype) if dtype.itemsize == 1 else gathered[:, : cols * 2].contiguous().view(dtype)
    got = kernels.swap_first_dims(gathered, world_size)
    assert torch.equal(got.view(torch.uint8), reference.swap_first_dims(gathered, world_size).view(torch.uint8))


def test_sharded_sr_equals_full_tensor():
    """Shards quantized with their sr_row_offset and gathered equal the full tensor quantized at once."""
    world_size, x = 4, random_input((4096, 2048), torch.bfloat16, seed=12)
    seed, local_rows = 31337, 4096 // 4
    full = kernels.quantize_tensor(x, rht=True, sr_seed=seed)
    shards = [kernels.quantize_tensor(x[r * local_rows:(r + 1) * local_rows], rht=True, sr_seed=seed,
                                      sr_row_offset=r * local_rows, amax_rowwise=full.amax_rowwise,
                                      amax_columnwise=full.amax_columnwise) for r in range(world_size)]
    assert torch.equal(torch.cat([s.rowwise_data for s in shards]), full.rowwise_data)
    gathered = torch.cat([s.columnwise_data for s in shards])
    assert torch.equal(kernels.swap_first_dims(gathered, world_size), full.columnwise_data)


def test_stochastic_rounding_statistics():
    """docs/numerics.md §7 on 8192 x 8192: each code is a neighbour of the exact scaled value, the mean over
    draws converges to it (closer than round-to-nearest), and two draws differ."""
    x = random_input((8192, 8192), torch.bfloat16, seed=21)
    nearest = kernels.quantize_tensor(x, columnwise=False)
    amax = nearest.amax_rowwise
    denominator = nearest.rowwise_scale.float() * decode_scale(amax)
    encode = torch.div(torch.ones_like(denominator), denominator).clamp(max=torch.finfo(torch.float32).max)  # docs/numerics.md §2.4
    exact = (x.float().reshape(8192, -1, 16) * encode[:, :, None]).clamp(-6, 6).reshape(8192, 8192)
    mags = torch.tensor(FP4_MAGNITUDES, device="cuda")
    lower = mags[(torch.bucketize(exact.abs(), mags, right=True) - 1).clamp(0, 7)]
    upper = mags[torch.bucketize(exact.abs(), mags, right=True).clamp(max=7)]
    draws, total = 32, torch.zeros_like(exact)
    previous = None
    for draw in range(draws):
        q = kernels.quantize_tensor(x, columnwise=False, sr_seed=1000 + draw, amax_rowwise=amax)
        assert torch.equal(q.rowwise_scale.view(torch.uint8), nearest.rowwise_scale.view(torch.uint8))
        values = fp4_to_float(q.rowwise_data)
        magnitude = values.abs()
        assert ((magnitude == lower) | (magnitude == upper)).all(), "an SR code is not a neighbour of its value"
        if previous is not None:
            assert not torch.equal(previous, q.rowwise_data), "two SR draws are identical"
        previous = q.rowwise_data
        total += values
    mean_error = (total / draws - exact).abs().mean().item()
    nearest_error = (fp4_to_float(nearest.rowwise_data) - exact).abs().mean().item()
    assert mean_error < nearest_error / 2, (mean_error, nearest_error)
    # Unbiased: the signed mean error over all elements is far below the per-element spread.
    assert abs((total / draws - exact).mean().item()) < 1e-3


def test_ops_dispatch_to_kernels():
    """nvfp4_dist.quantize on a CUDA tensor runs the kernels and equals the reference."""
    x = random_input((512, 1024), torch.bfloat16, seed=8)
    recipe = nv.NVFP4Recipe()
    for role in ("activation", "weight", "gradient"):
        q = nv.quantize(x, role, recipe=recipe, sr_seed=5)
        options = nv.ops.quantize_options(role, recipe)
        sr = options.pop("stochastic_rounding")
        r = reference.quantize_tensor(x, sr_seed=5 if sr else None, **options)
        assert_same(q, r)


# 4over6 (docs/numerics.md §12): every configuration Transformer Engine's tests list (MAE/MSE x bound 448/256 x exact/
# fast-math error), 1x16 and 16x16 blocks, with and without each copy.
FOUR_OVER_SIX_OPTIONS = [FourOverSix(mode, bound, fast) for mode in ("MAE", "MSE") for bound in (448, 256)
                         for fast in (False, True)]
FOUR_OVER_SIX_IDS = [f"{o.err_mode}-{o.e4m3_bound}-{'fast' if o.fast_math else 'exact'}" for o in FOUR_OVER_SIX_OPTIONS]
GOLDEN_V2 = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "te_reference_vectors_v2.npz"


@pytest.mark.parametrize("options", FOUR_OVER_SIX_OPTIONS, ids=FOUR_OVER_SIX_IDS)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_4over6_cast_matches_reference(shape, dtype, block_2d, options):
    x = random_input(shape, dtype, seed=shape[0] + 3 * shape[1] + FOUR_OVER_SIX_OPTIONS.index(options))
    q = kernels.quantize_tensor(x, block_2d=block_2d, four_over_six=options)
    assert q.e4m3_bound == options.e4m3_bound
    assert_same(q, reference.quantize_tensor(x, block_2d=block_2d, four_over_six=options))


@pytest.mark.parametrize("options", FOUR_OVER_SIX_OPTIONS, ids=FOUR_OVER_SIX_IDS)
@pytest.mark.parametrize("copies", ["rowwise_only", "columnwise_only"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("shape", [(304, 304), (2192, 11280)], ids=str)
def test_4over6_one_copy_matches_reference(shape, block_2d, copies, options):
    x = random_input(shape, torch.bfloat16, seed=17)
    kwargs = dict(rowwise=copies == "rowwise_only", columnwise=copies == "columnwise_only", block_2d=block_2d,
                  four_over_six=options)
    assert_same(kernels.quantize_tensor(x, **kwargs), reference.quantize_tensor(x, **kwargs))


@pytest.mark.parametrize("options", FOUR_OVER_SIX_OPTIONS, ids=FOUR_OVER_SIX_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(128, 128), (256, 272), (100, 64), (4096, 8208)], ids=str)
def test_4over6_row_scaled_matches_reference(shape, dtype, options):
    x = random_input(shape, dtype, seed=29)
    kwargs = dict(columnwise=False, row_scaled=True, four_over_six=options)
    assert_same(kernels.quantize_tensor(x, **kwargs), reference.quantize_tensor(x, **kwargs))


def _tie_input(rows, cols, seed):
    """FP32 blocks whose candidates' errors tie in exact arithmetic (tests/test_reference_fourover6.py)."""
    generator = torch.Generator().manual_seed(seed)
    ties = torch.tensor([0.625, 0.875, 2.125, 4.25, 5.25])
    t = ties[torch.randint(len(ties), (rows, cols), generator=generator)]
    t[::16, ::16] = 6.0
    signs = torch.where(torch.rand(rows, cols, generator=generator) < 0.5, -1.0, 1.0)
    tile_scale = torch.exp2(torch.randint(-3, 1, (rows // 16, cols // 16), generator=generator).float())
    tile_scale = tile_scale.repeat_interleave(16, dim=0).repeat_interleave(16, dim=1)
    return (t * signs * tile_scale * torch.tensor(1.1 / 1536)).cuda()


@pytest.mark.parametrize("options", FOUR_OVER_SIX_OPTIONS, ids=FOUR_OVER_SIX_IDS)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_4over6_near_ties_match_reference(block_2d, options):
    """Rounding decides these blocks' choices: the exact and fast-math errors, and the 16x16 sums' tree order."""
    x = _tie_input(1024, 2048, seed=5)
    assert_same(kernels.quantize_tensor(x, block_2d=block_2d, four_over_six=options),
                reference.quantize_tensor(x.cpu(), block_2d=block_2d, four_over_six=options))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["zeros", "largest", "subnormal", "bin_edges"])
def test_4over6_special_inputs(dtype, kind):
    x = special_inputs(dtype)[kind].cuda()
    for options in FOUR_OVER_SIX_OPTIONS:
        for kwargs in (dict(), dict(block_2d=True), dict(row_scaled=True, columnwise=False)):
            assert_same(kernels.quantize_tensor(x, four_over_six=options, **kwargs),
                        reference.quantize_tensor(x, four_over_six=options, **kwargs))


def test_4over6_gpu_reference_equals_cpu_reference():
    """The premise of running the 4over6 reference on the GPU above."""
    x = random_input((1024, 4096), torch.bfloat16, seed=3)
    for options in FOUR_OVER_SIX_OPTIONS:
        for block_2d in (False, True):
            assert_same(reference.quantize_tensor(x, block_2d=block_2d, four_over_six=options),
                        reference.quantize_tensor(x.cpu(), block_2d=block_2d, four_over_six=options))


def test_golden_v2_through_the_kernels():
    """Transformer Engine's reference bytes for every 4over6 configuration and the row-scaled columnwise copy."""
    golden = np.load(GOLDEN_V2)
    names = sorted({key.split("/")[0] for key in golden.files})
    assert len(names) == 36
    for name in names:
        config = json.loads(str(golden[f"{name}/config"]))
        dtype = getattr(torch, str(golden[f"{name}/input_dtype"]).split(".")[1])
        x = torch.from_numpy(golden[f"{name}/input_f32"]).to(dtype).cuda()
        kwargs = dict(block_2d=config["tile"] == [16, 16], columnwise=config["columnwise"],
                      row_scaled=config.get("row_scaled_nvfp4", False), rht=config.get("with_rht", False),
                      rht_random_sign=config.get("with_random_sign_mask", True))
        if config.get("nvfp4_use_4over6"):
            kwargs["four_over_six"] = FourOverSix(config["nvfp4_4over6_err_mode"], config["nvfp4_e4m3_max"],
                                                  config.get("nvfp4_4over6_err_use_fast_math", False))
        q = kernels.quantize_tensor(x, **kwargs)
        pairs = {"data": q.rowwise_data, "scale": q.rowwise_scale}
        if config["columnwise"]:
            pairs.update(data_t=q.columnwise_data, scale_t=q.columnwise_scale, amax_col=q.amax_columnwise)
        for key, ours in pairs.items():
            ours = (ours if ours.dtype == torch.float32 else ours.view(torch.uint8)).cpu().numpy()
            theirs = golden[f"{name}/{key}"]
            theirs = theirs[:, :ours.shape[1]] if key.startswith("scale") else theirs
            assert np.array_equal(ours, theirs), f"{name}/{key}: {int((ours != theirs).sum())} bytes differ"


@pytest.mark.parametrize("bound", [448, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_4over6_dequantize_matches_reference(dtype, bound):
    x = random_input((1024, 2048), dtype, seed=2)
    for kwargs in (dict(), dict(block_2d=True), dict(row_scaled=True, columnwise=False)):
        q = kernels.quantize_tensor(x, four_over_six=FourOverSix("MSE", bound), **kwargs)
        for copy in ("rowwise", "columnwise"):
            if getattr(q, f"{copy}_data") is None:
                continue
            got = kernels.dequantize_tensor(q, dtype, copy).cpu().contiguous()
            want = reference.dequantize_tensor(q.to("cpu"), dtype, copy).contiguous()
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (kwargs, copy)


def test_4over6_refusals():
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    for kwargs, message in ((dict(rht=True), "RHT"), (dict(sr_seed=3), "stochastic"),
                            (dict(row_scaled=True), "row-scaled")):
        with pytest.raises(ValueError, match=message):
            kernels.quantize_tensor(x, four_over_six=FourOverSix(), **kwargs)


# The columnwise copy of a row-scaled activation (docs/numerics.md §6b): one amax per row of x^T, after the RHT.
ROW_SCALED_COLUMNWISE = {"plain": dict(), "rht": dict(rht=True), "rht_plain_sign": dict(rht=True, rht_random_sign=False)}


@pytest.mark.parametrize("variant", list(ROW_SCALED_COLUMNWISE))
@pytest.mark.parametrize("shape", SHAPES + [(8192, 11328)], ids=str)
def test_row_scaled_columnwise_matches_reference(shape, variant):
    x = random_input(shape, torch.bfloat16, seed=shape[0] + shape[1])
    kwargs = dict(row_scaled=True, **ROW_SCALED_COLUMNWISE[variant])
    q = kernels.quantize_tensor(x, **kwargs)
    assert q.amax_columnwise.shape == (shape[1],)
    r = reference.quantize_tensor(x.cpu() if kwargs.get("rht") else x, **kwargs)
    assert_same(q, r)
    assert_same(kernels.quantize_tensor(x, rowwise=False, **kwargs), r, copies=("columnwise",))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(304, 304), (4096, 8208)], ids=str)
def test_row_scaled_columnwise_other_dtypes(shape, dtype):
    x = random_input(shape, dtype, seed=4)
    assert_same(kernels.quantize_tensor(x, row_scaled=True), reference.quantize_tensor(x, row_scaled=True))


@pytest.mark.parametrize("dtype,rht", [(dtype, False) for dtype in DTYPES] + [(torch.bfloat16, True)], ids=str)
def test_column_amaxes(dtype, rht):
    x = random_input((4112, 4096), dtype, seed=6)
    got = kernels.compute_amaxes(x, rowwise=False, rht=rht, row_scaled=True)[1]
    want = reference.compute_amaxes(x.cpu(), rowwise=False, rht=rht, row_scaled=True)[1]
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("variant", list(ROW_SCALED_COLUMNWISE))
def test_row_scaled_columnwise_dequantize_matches_reference(variant):
    x = random_input((1024, 2048), torch.bfloat16, seed=7)
    q = kernels.quantize_tensor(x, row_scaled=True, **ROW_SCALED_COLUMNWISE[variant])
    got = kernels.dequantize_tensor(q, torch.bfloat16, "columnwise").cpu().contiguous()
    want = reference.dequantize_tensor(q.to("cpu"), torch.bfloat16, "columnwise").contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("variant", list(ROW_SCALED_COLUMNWISE))
def test_row_scaled_columnwise_shards_equal_full_tensor(variant):
    """Token shards quantized with the MAX of their per-column amaxes and gathered (swap_first_dims) equal the
    full tensor's columnwise copy (sequence parallelism, docs/numerics.md §6b)."""
    world_size, x = 4, random_input((4096, 2048), torch.bfloat16, seed=13)
    kwargs = dict(row_scaled=True, **ROW_SCALED_COLUMNWISE[variant])
    full = kernels.quantize_tensor(x, **kwargs)
    local_rows = 4096 // world_size
    shards = x.split(local_rows)
    reduced = torch.stack([kernels.compute_amaxes(s, rowwise=False, **kwargs)[1] for s in shards]).amax(dim=0)
    assert torch.equal(reduced, full.amax_columnwise)
    pieces = [kernels.quantize_tensor(s, amax_columnwise=reduced, **kwargs) for s in shards]
    assert torch.equal(kernels.swap_first_dims(torch.cat([p.columnwise_data for p in pieces]), world_size),
                       full.columnwise_data)
    scales = torch.cat([p.columnwise_scale.view(torch.uint8) for p in pieces])
    assert torch.equal(kernels.swap_first_dims(scales, world_size), full.columnwise_scale.view(torch.uint8))


def test_ops_dispatch_4over6_and_row_scaled_columnwise():
    """nvfp4_dist.quantize with the recipe's 4over6 and row-scaled options runs the kernels and equals the reference."""
    x = random_input((512, 1024), torch.bfloat16, seed=8)
    recipes = [nv.NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="weights",
                              nvfp4_4over6_err_mode="MSE", nvfp4_4over6_err_use_fast_math=True),
               nv.NVFP4Recipe(nvfp4_4over6="weights"),
               nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)]
    for recipe in recipes:
        for role in ("activation", "weight", "gradient"):
            q = nv.quantize(x, role, recipe=recipe, sr_seed=5)
            options = nv.ops.quantize_options(role, recipe)
            sr = options.pop("stochastic_rounding")
            r = reference.quantize_tensor(x.cpu() if options["rht"] else x, sr_seed=5 if sr else None, **options)
            assert_same(q, r)


@pytest.mark.parametrize("shape", [(64, 32), (4096, 1152), (16, 8), (130, 33), (2, 1)])
def test_transpose_codes_kernel_matches_reference(shape):
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    assert torch.equal(nv.ops.transpose_codes(packed).cpu(), reference.transpose_codes(packed.cpu()))
