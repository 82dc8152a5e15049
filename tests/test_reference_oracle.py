"""The reference (nvfp4_dist.reference) against the independent oracle (tests/helpers/oracle.py), byte for byte.

The oracle itself is pinned first, to outside definitions: its E4M3 decode and encode against torch's float8 cast,
its Philox against Random123's known answers (10 rounds) and hard-coded Philox4x32-7 words, its RHT against the
float64 matrix product, and its quantization against every one of Transformer Engine's golden vectors (tests/data).
"""
import json

import numpy as np
import pytest
import torch

from nvfp4_dist import reference
from tests.helpers import oracle as O

UNIT_AMAX = np.array([2688.0], dtype=np.float32)  # S_enc = S_dec = 1: a block whose max is 6 gets scale 1

# Philox4x32-7 words, computed once by the oracle's plain-Python Philox (written from the Random123 definition):
# (counter, seed, words); the key is (seed low word, seed high word).
PHILOX7_WORDS = [
    ((0, 0, 0, 0), 0x0, (0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48)),
    ((0, 0, 0, 0), 0x123456789abcdef, (0xf4701821, 0x94947e0d, 0x0b7b993b, 0x02d0c2a6)),
    ((1, 5, 0, 0), 0x123456789abcdef, (0xd6c204e3, 0xc27fca67, 0xcd2be8a1, 0x75d42ecd)),
    ((1, 5, 1, 0), 0x123456789abcdef, (0xec5de706, 0xb50857f5, 0x0f9f884b, 0x7a29a078)),
    ((7, 300, 1, 0), 0x3fffffffffffffff, (0x347aa6e7, 0xc086700b, 0x21136f75, 0x55efd848)),
]
# Random123's kat_vectors for philox4x32_10: (counter, key, words).
PHILOX10_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
# Amaxes at which 2688 * (1 / A) is not the correctly rounded 2688 / A (docs/numerics.md §2.2's trap).
TRAP_AMAXES = (0.625, 3.25, 13.375, 133.0)


def key(seed):
    return seed & 0xFFFFFFFF, seed >> 32


def assert_same_bytes(q, expected: O.Quantized, what):
    for copy in ("rowwise", "columnwise"):
        mine = getattr(expected, copy)
        if mine is None:
            assert getattr(q, f"{copy}_data") is None, (what, copy)
            continue
        O.check_copy(f"{what} {copy}", getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"),
                     getattr(q, f"amax_{copy}"), mine)


# ------------------------------------------------------------------------------------------------------
# The oracle pinned to outside definitions.

def test_oracle_e4m3_and_e2m1_tables():
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(O.E4M3, torch_values, equal_nan=True)
    assert O.E4M3[0x7E] == 448.0 and O.E4M3[0x01] == 2.0 ** -9 and np.isnan(O.E4M3[0x7F])
    assert O.E2M1[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert np.signbit(O.E2M1[8]) and (O.E2M1[8:] == -O.E2M1[:8]).all()
    codes = np.array([[2, 4, 15, 1]], dtype=np.uint8)
    assert O.pack(codes).tolist() == [[0x42, 0x1F]] and np.array_equal(O.unpack(O.pack(codes)), codes)


def test_oracle_e4m3_encode_rounds_like_torch():
    values = O.E4M3_POSITIVE
    midpoints = (values[:-1] + values[1:]) / 2
    probes = np.concatenate([values, midpoints, np.nextafter(midpoints.astype(np.float32), np.float32(0)),
                             np.nextafter(midpoints.astype(np.float32), np.float32(500)),
                             np.random.default_rng(0).uniform(0, 448, 20000), [1e-30, 2.0 ** -10]]).astype(np.float32)
    torch_bytes = torch.from_numpy(probes).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(O.encode_e4m3(probes), torch_bytes)


def test_oracle_philox_known_answers():
    for counter, k, words in PHILOX10_KAT:
        assert O.philox4x32(counter, k, 10) == words
    for counter, seed, words in PHILOX7_WORDS:
        assert O.philox4x32(counter, key(seed), 7) == words
        vectorised = O.philox4x32_numpy(*(np.array([c]) for c in counter), key(seed), 7)
        assert tuple(int(w[0]) for w in vectorised) == words


def golden_options(golden, name: str) -> dict:
    """The oracle's quantize() options of a Transformer Engine golden case: its JSON config (v2), or its name (v1)."""
    if f"{name}/config" in golden.files:
        config = json.loads(str(golden[f"{name}/config"]))
        options = dict(block_2d=config["tile"] == [16, 16], columnwise=config["columnwise"],
                       row_scaled=config.get("row_scaled_nvfp4", False), rht=config.get("with_rht", False),
                       random_sign=config.get("with_random_sign_mask", True))
        if config.get("nvfp4_use_4over6"):
            options["four_over_six"] = O.FourOverSix(config["nvfp4_4over6_err_mode"], config["nvfp4_e4m3_max"],
                                                     config.get("nvfp4_4over6_err_use_fast_math", False))
        return options
    return dict(block_2d="2d" in name, rht="rht" in name, row_scaled="rowscaled" in name,
                columnwise=f"{name}/data_t" in golden.files)


def test_oracle_reproduces_transformer_engines_vectors(golden, golden_v2):
    checked = 0
    for vectors in (golden, golden_v2):
        for name in sorted({key.split("/")[0] for key in vectors.files}):
            dtype = getattr(torch, str(vectors[f"{name}/input_dtype"]).split(".")[1])
            x = torch.from_numpy(vectors[f"{name}/input_f32"]).to(dtype)
            q = O.quantize(x, **golden_options(vectors, name))
            for copy, suffix in (("rowwise", ""), ("columnwise", "_t")):
                mine = getattr(q, copy)
                if mine is None:
                    continue
                scale = vectors[f"{name}/scale{suffix}"][:, :mine.scale.shape[1]]  # TE's padding columns
                amax = vectors[f"{name}/amax_{'row' if copy == 'rowwise' else 'col'}"]
                expected = O.Copy(vectors[f"{name}/data{suffix}"], scale, amax)
                O.check_copy(f"{name} {copy}", torch.from_numpy(mine.data),
                             torch.from_numpy(mine.scale).view(torch.float8_e4m3fn), torch.from_numpy(mine.amax),
                             expected)
            checked += 1
    assert checked == 41


def test_oracle_rht_is_the_orthogonal_matrix_product():
    for random_sign in (True, False):
        h = O.rht_matrix(random_sign)
        assert np.array_equal(h @ h.T, np.eye(16))
    generator = np.random.default_rng(1)
    x = O.round_to_bf16(generator.standard_normal((64, 48)).astype(np.float32))
    exact = (x.T.astype(np.float64).reshape(48, 4, 16) @ O.rht_matrix()).reshape(48, 64)
    transformed = O.rht_columnwise_source(x).astype(np.float64)
    # FP32 butterflies (4 levels) then one BF16 rounding
    bound = 2.0 ** -8 * np.abs(exact) + 5 * 2.0 ** -24 * (np.abs(x.T).reshape(48, 4, 16) @ np.abs(O.rht_matrix())
                                                         ).reshape(48, 64)
    assert (np.abs(transformed - exact) <= bound).all()


# ------------------------------------------------------------------------------------------------------
# The reference's Philox and stochastic-rounding stream.

def test_reference_philox_known_answers():
    for counter, k, words in PHILOX10_KAT:
        got = reference.philox4x32([torch.tensor(c) for c in counter], k, 10)
        assert tuple(int(w) for w in got) == words
    for counter, seed, words in PHILOX7_WORDS:
        got = reference.philox4x32([torch.tensor(c) for c in counter], key(seed), 7)
        assert tuple(int(w) for w in got) == words


def test_reference_sr_bits_follow_the_counter_layout():
    # counter (col // 16, row, stream, 0): the hard-coded words give the bytes of 16 columns each
    for counter, seed, words in PHILOX7_WORDS[1:]:
        group, row, stream, _ = counter
        cols = torch.arange(16) + 16 * group
        bits = reference.stochastic_rounding_bits(torch.full((16,), row), cols, stream, seed)
        expected = [(words[c // 4] >> (8 * (c % 4))) & 0xFF for c in range(16)]
        assert (bits // 256).tolist() == expected and (bits % 256 == 0).all()
    rows, cols = np.meshgrid(np.arange(40, 47), np.arange(5, 70), indexing="ij")
    for stream in (0, 1):
        got = reference.stochastic_rounding_bits(torch.from_numpy(rows), torch.from_numpy(cols), stream, 2 ** 40 + 3)
        assert np.array_equal(got.numpy(), 256 * O.sr_bytes(rows, cols, stream, 2 ** 40 + 3))


def half_way_tensor(rows, cols):
    """Unit-scale blocks in both directions (a 6 opens every 16-block of rows and of columns); every other element
    sits half way between grid points, so stochastic rounding goes up iff its random byte is below 128."""
    generator = np.random.default_rng(rows * cols)
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    x = generator.choice(midpoints, (rows, cols)) * generator.choice(np.array([1, -1], np.float32), (rows, cols))
    x[::16, :] = 6.0
    x[:, ::16] = 6.0
    return torch.from_numpy(x.astype(np.float32))


def test_sr_streams_of_the_two_copies_are_their_own():
    x = half_way_tensor(64, 96)
    seed, first_row = 0x0123456789ABCDEF, 48
    amax = torch.tensor([2688.0])
    q = reference.quantize_tensor(x, sr_seed=seed, sr_row_offset=first_row, amax_rowwise=amax, amax_columnwise=amax)
    expected = O.quantize(x, sr_seed=seed, first_row=first_row, amax_rowwise=UNIT_AMAX, amax_columnwise=UNIT_AMAX)
    assert_same_bytes(q, expected, "half-way SR")
    # the byte rule at p = 1/2, spelled out for the rowwise copy: up iff the byte of (first_row + m, k) is < 128
    rows, cols = np.meshgrid(np.arange(64) + first_row, np.arange(96), indexing="ij")
    up = O.sr_bytes(rows, cols, O.ROWWISE_STREAM, seed) < 128
    magnitude = np.abs(x.numpy())
    halfway = magnitude != 6.0
    lower = O.E2M1_MAGNITUDES[np.searchsorted(O.E2M1_MAGNITUDES, magnitude, side="right") - 1]
    got = O.E2M1[O.unpack(q.rowwise_data.numpy())]
    assert np.array_equal(np.abs(got)[halfway] > lower[halfway], up[halfway])
    # the columnwise copy draws stream 1 at (k, first_row + m): not the rowwise stream's bytes
    rowwise_stream_for_columnwise = O.quantize(x, rowwise=False, sr_seed=seed, first_row=first_row,
                                               amax_columnwise=UNIT_AMAX)
    rowwise_stream_for_columnwise.columnwise = O.quantize_blocks(
        x.numpy().T, UNIT_AMAX, sr_seed=seed, first_col=first_row, stream=O.ROWWISE_STREAM)
    assert not np.array_equal(rowwise_stream_for_columnwise.columnwise.data, expected.columnwise.data)


def test_sr_rounds_up_only_below_the_probability():
    """Elements whose p * 256 equals their random byte b exactly stay down (the rule is byte < p * 256); one
    step more (p = (b + 1) / 256) goes up."""
    seed, rows, cols = 99, 32, 64
    positions = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    random_bytes = O.sr_bytes(*positions, O.ROWWISE_STREAM, seed).astype(np.float32)
    for extra, goes_up in ((0, False), (1, True)):
        x = (0.5 * (np.minimum(random_bytes + extra, 255) / 256)).astype(np.float32)  # between 0 and 0.5
        x[:, ::16] = 6.0
        data, _ = reference.quantize_blocks(torch.from_numpy(x), torch.tensor([2688.0]), sr_seed=seed)
        codes = O.unpack(data.numpy())
        probed = (x != 6.0) & (x > 0) & (random_bytes + extra <= 255)
        assert probed.sum() > 1000
        assert ((codes[probed] == 1) == goes_up).all(), int((codes[probed] == 1).sum())


def test_sr_never_moves_grid_values_or_zeros():
    generator = np.random.default_rng(3)
    x = generator.choice(O.E2M1, (32, 64)).astype(np.float32)
    x[:, ::16] = 6.0
    x[5] = 0.0
    nearest = reference.quantize_blocks(torch.from_numpy(x), torch.tensor([2688.0]))[0]
    for seed in range(40):
        data, _ = reference.quantize_blocks(torch.from_numpy(x), torch.tensor([2688.0]), sr_seed=seed,
                                            sr_offset=(seed, 3 * seed), sr_stream=seed % 2)
        assert torch.equal(data, nearest), seed


# ------------------------------------------------------------------------------------------------------
# Global scale: one correctly rounded division.

def test_global_scale_is_the_correctly_rounded_division():
    traps = np.array(TRAP_AMAXES, dtype=np.float32)
    assert (O.GLOBAL_NUMERATOR * (np.float32(1) / traps) != O.GLOBAL_NUMERATOR / traps).all()  # they discriminate
    sweep = np.random.default_rng(4).uniform(1e-3, 1e4, 20000).astype(np.float32)
    assert (O.GLOBAL_NUMERATOR * (np.float32(1) / sweep) != O.GLOBAL_NUMERATOR / sweep).sum() > 1000
    for amaxes in (traps, sweep, np.array([0.0, np.inf, 3.4e38, 1e-30, 2688.0], dtype=np.float32)):
        got = reference.encode_scale(torch.from_numpy(amaxes)).numpy()
        assert np.array_equal(got.view(np.uint32), O.encode_scale(amaxes).view(np.uint32))
        assert np.array_equal(reference.decode_scale(torch.from_numpy(amaxes)).numpy().view(np.uint32),
                              O.decode_scale(amaxes).view(np.uint32))


def division_trap_tensor(amax: float) -> torch.Tensor:
    """FP32 [R, 64] with max |x| = amax, whose bytes differ between S_enc = 2688 / A and 2688 * (1 / A): blocks whose
    maximum times S_enc / 6 lands next to a midpoint of two E4M3 values (the scale flips), and blocks of the largest
    scale whose elements land next to E2M1 ties (the codes flip through e_b = 1 / (s_b * S_dec))."""
    a = np.array([amax], np.float32)
    s_right = O.encode_scale(a)
    sixth = np.float32(1) / np.float32(6)
    near = [np.float32(1 + k * 2.0 ** -23) for k in range(-3, 4)]
    midpoints = ((O.E4M3_POSITIVE[1:] + O.E4M3_POSITIVE[:-1]) / 2).astype(np.float32)
    maxima = np.concatenate([(midpoints / (s_right * sixth)).astype(np.float32) * k for k in near])
    maxima = maxima[(maxima > 0) & (maxima < amax)]
    top_scale = O.E4M3[O.encode_e4m3(np.minimum(a * (s_right * sixth), np.float32(448)))].astype(np.float32)
    e_b = np.float32(1) / (top_scale * (np.float32(1) / s_right))
    ties = np.concatenate([(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32) / e_b).astype(np.float32) * k
                           for k in near])
    generator = np.random.default_rng(5)
    blocks = [np.concatenate([[m], generator.uniform(-m / 2, m / 2, 15)]) for m in maxima]
    blocks += [np.concatenate([[amax], group, np.zeros(15 - group.size)]) for group in np.array_split(
        ties, -(-ties.size // 15))]
    blocks += [generator.uniform(-amax / 2, amax / 2, 16) for _ in range(-len(blocks) % 4)]
    return torch.from_numpy(np.stack(blocks).astype(np.float32).reshape(-1, 64))


@pytest.mark.parametrize("amax", TRAP_AMAXES)
def test_bytes_at_the_division_trap(amax):
    x = division_trap_tensor(amax)
    assert x.abs().max().item() == amax
    expected = O.quantize(x, columnwise=False)
    wrong = O.quantize_blocks(x.numpy(), np.array([amax], np.float32),
                              s_enc=O.GLOBAL_NUMERATOR * (np.float32(1) / np.float32(amax)))
    assert not (np.array_equal(wrong.data, expected.rowwise.data)
                and np.array_equal(wrong.scale, expected.rowwise.scale)), "the input does not tell the divisions apart"
    assert_same_bytes(reference.quantize_tensor(x, columnwise=False), expected, f"amax {amax}")


# ------------------------------------------------------------------------------------------------------
# Every quantization the reference does, byte for byte.

def wide_range(rows, cols, seed, low=-20, high=20, dtype=torch.float32):
    generator = np.random.default_rng(seed)
    x = generator.standard_normal((rows, cols)).astype(np.float32)
    octaves = np.repeat(generator.integers(low, high, (rows, cols // 16)), 16, axis=1)
    return torch.from_numpy((x * np.exp2(octaves)).astype(np.float32)).to(dtype)


CASES = {
    "1d": dict(),
    "2d": dict(block_2d=True),
    "rht": dict(rht=True),
    "rht_plain_hadamard": dict(rht=True, random_sign=False),
    "sr": dict(sr_seed=0x0123456789ABCDEF, first_row=48),
    "rht_sr": dict(rht=True, sr_seed=2 ** 62 - 1, first_row=16),
    "row_scaled": dict(row_scaled=True),
    "row_scaled_rht": dict(row_scaled=True, rht=True),
    "row_scaled_rowwise_sr": dict(row_scaled=True, columnwise=False, sr_seed=77, first_row=16),
    **{f"4over6_{'2d' if tiles else '1d'}_{mode}_{bound}_{'fast' if fast else 'exact'}": dict(
        block_2d=tiles, four_over_six=O.FourOverSix(mode, bound, fast))
       for tiles in (False, True) for mode in ("MAE", "MSE") for bound in (448, 256) for fast in (False, True)},
    "4over6_row_scaled": dict(row_scaled=True, columnwise=False, four_over_six=O.FourOverSix("MSE", 256, False)),
}


def reference_options(options: dict) -> dict:
    """The oracle's quantize() options as nvfp4_dist.reference.quantize_tensor's keywords."""
    from nvfp4_dist.reference.fourover6 import FourOverSix
    renamed = {"random_sign": "rht_random_sign", "first_row": "sr_row_offset"}
    result = {renamed.get(k, k): v for k, v in options.items() if k != "four_over_six"}
    if options.get("four_over_six") is not None:
        f = options["four_over_six"]
        result["four_over_six"] = FourOverSix(f.err_mode, f.bound, f.fast_math)
    return result


# The RHT takes BF16 input only (docs/numerics.md §5).
CASE_DTYPES = [pytest.param(case, dtype, id=f"{case}-{str(dtype).split('.')[1]}") for case, options in CASES.items()
               for dtype in ((torch.bfloat16,) if options.get("rht") else (torch.bfloat16, torch.float16, torch.float32))]


@pytest.mark.parametrize("case,dtype", CASE_DTYPES)
def test_reference_bytes_equal_the_oracle(case, dtype):
    options = CASES[case]
    low, high = (-12, 12) if dtype == torch.float16 else (-20, 20)
    x = wide_range(64, 96, seed=len(case), low=low, high=high, dtype=dtype)
    x[3] = 0
    x[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, -0.1, 6, -6, 1e-3, -1e-3, 3, 4, 0.5])
    q = reference.quantize_tensor(x, **reference_options(options))
    assert_same_bytes(q, O.quantize(x, **options), case)


@pytest.mark.parametrize("amax", [2688.0, 0.0, float("inf"), 3.4e38, 1e-30, 6.0])
def test_reference_bytes_at_extreme_amaxes(amax):
    x = wide_range(32, 64, seed=7, low=-4, high=4)
    x[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, -0.1, 6, -6, 1e-30, -1e-30, 3, 4, 0.5])
    given = torch.tensor([amax])
    q = reference.quantize_tensor(x, amax_rowwise=given, amax_columnwise=given)
    assert_same_bytes(q, O.quantize(x, amax_rowwise=given.numpy(), amax_columnwise=given.numpy()), f"amax {amax}")


DEQUANTIZE_CASES = {"1d": dict(), "2d": dict(block_2d=True), "row_scaled": dict(row_scaled=True),
                    "4over6_256": dict(four_over_six=O.FourOverSix("MAE", 256, False))}


@pytest.mark.parametrize("case", list(DEQUANTIZE_CASES))
def test_dequantize_equals_the_oracle_decode(case):
    x = wide_range(48, 64, seed=9, low=-10, high=10, dtype=torch.bfloat16)
    options = DEQUANTIZE_CASES[case]
    q = reference.quantize_tensor(x, **reference_options(options))
    expected = O.quantize(x, **options)
    for copy in ("rowwise", "columnwise"):
        if getattr(expected, copy) is None:
            continue
        got = reference.dequantize_tensor(q, torch.float32, copy).numpy()
        decoded = getattr(expected, copy).decoded().astype(np.float32)
        assert np.array_equal(got, decoded if copy == "rowwise" else decoded.T), (case, copy)
