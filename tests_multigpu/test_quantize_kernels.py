"""The CUDA quantization kernels (nvfp4_dist.kernels) against the reference, byte for byte (docs/numerics.md §11).

Codes, unpadded scales and amax must be identical. The reference runs on the GPU (the same torch
ops, correctly rounded, give the same bits as on the CPU; test_gpu_reference_equals_cpu_reference
checks that), except the RHT, whose FP32 matmul runs on the CPU: its summation order is the SPEC's.
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import kernels, reference
from nvfp4_dist.formats import FP4_MAGNITUDES, fp4_to_float
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
