"""An independent NVFP4 oracle: the rules of docs/numerics.md written again in numpy, sharing no code with nvfp4_dist.

Tests compare the package with it, never the package with itself:
- formats (docs/numerics.md §1): the E2M1 table and the E4M3 decode are written out from their bit layouts here;
  encoding rounds to the nearest table value, ties to the even code;
- quantization (§2, 4, 6, 6b, 12): FP32 arithmetic step by step, in numpy float32 (IEEE, correctly rounded), the
  global scale as one FP32 division 6 B / A (B = 448: 2688 / A; or 256 for some 4over6 tensors), 4over6's two
  candidates and their errors in the documented order;
- stochastic rounding (§7): Philox4x32 written from the Random123 definition in plain Python integers (and
  vectorised in numpy uint64), with the documented counter layout;
- RHT (§5): diag(s) . H16 / 4 from the Sylvester construction, applied by FP32 butterflies;
- dequantize-and-multiply in float64 from the decoded bytes, with elementwise error bounds derived from the
  formats for what an FP32-accumulating GEMM and the BF16 output may add.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
BLOCK = 16
E4M3_LARGEST = 448                      # the global-scale bound B of plain NVFP4
GLOBAL_NUMERATOR = F32(6 * E4M3_LARGEST)  # 6 B = 2688: E2M1 max times E4M3 max
FP32_UNIT_ROUNDOFF = 2.0 ** -24         # half an FP32 ulp, relative
BF16_UNIT_ROUNDOFF = 2.0 ** -8          # half a BF16 ulp, relative (8 significant bits)
ROWWISE_STREAM, COLUMNWISE_STREAM = 0, 1  # Philox counter word 2 of each copy's SR bits

# E2M1, docs/numerics.md §1: codes 0..7 are these magnitudes, 8..15 the same negated (8 is -0).
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1 = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])


def e4m3_value(byte: int) -> float:
    """FP8 E4M3 (fn): sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 is subnormal
    (mantissa / 8 * 2^-6); 0x7F / 0xFF are NaN, there is no infinity."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3 = np.array([e4m3_value(b) for b in range(256)])
E4M3_POSITIVE = E4M3[:0x7F]  # codes 0..126: 0, the subnormals, then up to 448, ascending


def round_to_table(magnitude: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of an ascending table to each magnitude (within the table's range), ties to the
    even index (the even code: the mantissa's last bit 0). Exact: float64 differences of FP32 values near a tie."""
    a = magnitude.astype(np.float64)
    upper = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lower = np.clip(upper - 1, 0, None)
    to_lower, to_upper = a - table[lower], table[upper] - a
    pick_lower = (to_lower < to_upper) | ((to_lower == to_upper) & (lower % 2 == 0))
    return np.where(table[upper] == a, upper, np.where(pick_lower, lower, upper))


def encode_e4m3(v: np.ndarray) -> np.ndarray:
    """E4M3 bytes of FP32 values in [0, 448] (block scales), round to nearest even."""
    return round_to_table(v, E4M3_POSITIVE).astype(np.uint8)


def encode_e2m1(v: np.ndarray) -> np.ndarray:
    """E2M1 codes of FP32 values in [-6, 6], round to nearest even; a negative value that rounds to 0 is -0
    (code 8); -0.0 itself is code 0 (docs/numerics.md §2.5)."""
    code = round_to_table(np.abs(v), E2M1_MAGNITUDES).astype(np.uint8)
    return np.where(v < 0, code | 8, code).astype(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    """[.., K] codes -> [.., K/2] bytes: element 2i in the low nibble, 2i + 1 in the high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray) -> np.ndarray:
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0xF, packed >> 4
    return codes


# ------------------------------------------------------------------------------------------------------
# Global scale (docs/numerics.md §2.2): one correctly rounded FP32 division.

def encode_scale(amax, bound: int = E4M3_LARGEST) -> np.ndarray:
    """S_enc = min(6 B / A, FLT_MAX), 1 where that is 0 (A = inf); B = 448 (2688 / A), or 256 (§12.1)."""
    amax = np.asarray(amax, dtype=F32)
    with np.errstate(divide="ignore"):
        s_enc = np.minimum(F32(6 * bound) / amax, FLT_MAX)
    return np.where(s_enc == 0, F32(1), s_enc).astype(F32)


def decode_scale(amax, bound: int = E4M3_LARGEST) -> np.ndarray:
    """S_dec = 1 / S_enc, one FP32 division."""
    return (F32(1) / encode_scale(amax, bound)).astype(F32)


# ------------------------------------------------------------------------------------------------------
# Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123).

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
MASK32 = 0xFFFFFFFF
SR_ROUNDS = 7


def philox4x32(counter, key, rounds: int) -> tuple:
    """One Philox4x32-`rounds` block in plain Python integers: each round multiplies counter words 0 and 2 by
    the round constants, swaps and mixes the halves with words 1, 3 and the key; the key then adds the Weyl
    increments."""
    c0, c1, c2, c3 = (int(c) & MASK32 for c in counter)
    k0, k1 = (int(k) & MASK32 for k in key)
    for _ in range(rounds):
        p0, p1 = PHILOX_M[0] * c0, PHILOX_M[1] * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
    return c0, c1, c2, c3


def philox4x32_numpy(c0, c1, c2, c3, key, rounds: int):
    """philox4x32 over arrays of counter words (uint64 holding 32 bits)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & np.uint64(MASK32) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(key[0] & MASK32), np.uint64(key[1] & MASK32)
    m0, m1, mask = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1]), np.uint64(MASK32)
    for _ in range(rounds):
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & mask, (k1 + np.uint64(PHILOX_W[1])) & mask
    return c0, c1, c2, c3


def sr_bytes(rows: np.ndarray, cols: np.ndarray, stream: int, seed: int) -> np.ndarray:
    """The random byte of each element at global (row, col) of a copy (docs/numerics.md §7): one Philox4x32-7 call
    per row and group of 16 columns, counter (col // 16, row, stream, 0), key (seed low word, seed high word);
    column col takes byte (col % 16) % 4 of word (col % 16) // 4."""
    rows, cols = np.broadcast_arrays(np.asarray(rows, dtype=np.uint64), np.asarray(cols, dtype=np.uint64))
    words = philox4x32_numpy(cols // np.uint64(16), rows, np.full(rows.shape, stream, dtype=np.uint64),
                             np.zeros(rows.shape, dtype=np.uint64), (seed & MASK32, (seed >> 32) & MASK32), SR_ROUNDS)
    within = cols % np.uint64(16)
    word = np.choose((within // np.uint64(4)).astype(np.int64), words)
    return ((word >> (np.uint64(8) * (within % np.uint64(4)))) & np.uint64(0xFF)).astype(np.int64)


def stochastic_e2m1(v: np.ndarray, random_bytes: np.ndarray, levels: int = 256) -> np.ndarray:
    """SR codes of FP32 values in [-6, 6]: |v| between grid neighbours lo <= |v| <= hi rounds up iff
    byte < p * 256, p = (|v| - lo) / (hi - lo) in FP32 (0 where |v| is on the grid or at 6). levels: the range of
    the random integers (65536 for the 16-bit values the kernels' rule takes)."""
    a = np.abs(v).astype(F32)
    lower = np.clip(np.searchsorted(E2M1_MAGNITUDES, a, side="right") - 1, 0, 7)
    upper = np.clip(lower + 1, 0, 7)
    lo, hi = E2M1_MAGNITUDES[lower].astype(F32), E2M1_MAGNITUDES[upper].astype(F32)
    gap = hi - lo
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(gap > 0, (a - lo) / np.where(gap > 0, gap, F32(1)), F32(0)).astype(F32)
    up = random_bytes.astype(F32) < p * F32(levels)
    code = np.where(up, upper, lower).astype(np.uint8)
    return np.where(v < 0, code | 8, code).astype(np.uint8)


# ------------------------------------------------------------------------------------------------------
# RHT (docs/numerics.md §5).

RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)


def sylvester_hadamard(n: int = 16) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def rht_matrix(random_sign: bool = True) -> np.ndarray:
    """H = diag(s) . H16 / 4 (or H16 / 4), float64."""
    signs = RHT_SIGNS if random_sign else np.ones(16)
    return signs[:, None] * sylvester_hadamard() / 4


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """FP32 -> the nearest BF16 value (ties to even), as FP32 (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(F32)


def rht_columnwise_source(x2d: np.ndarray, random_sign: bool = True) -> np.ndarray:
    """x [M, K] (BF16 values) -> x^T [K, M] with each 16-chunk along M multiplied by H: terms c_i * (s_i / 4)
    (exact), then the fast Walsh-Hadamard butterflies in FP32 ((a, b) -> (a + b, a - b) on pairs (i, i + h) for
    h = 1, 2, 4, 8), rounded to BF16."""
    cols, rows = x2d.shape[1], x2d.shape[0]
    signs = (RHT_SIGNS if random_sign else np.ones(16)).astype(F32)
    t = x2d.T.astype(F32).reshape(cols, rows // BLOCK, BLOCK) * (signs / F32(4))
    h = 1
    while h < BLOCK:
        t = t.reshape(cols, rows // BLOCK, BLOCK // (2 * h), 2, h)
        a, b = t[..., 0, :], t[..., 1, :]
        t = np.stack([a + b, a - b], axis=-2)
        h *= 2
    return round_to_bf16(t.reshape(cols, rows))


# ------------------------------------------------------------------------------------------------------
# Quantization (docs/numerics.md §2, 4, 6, 7).

@dataclasses.dataclass
class Copy:
    """One quantized copy: packed codes uint8 [R, C/2], E4M3 scale bytes uint8 [R, C/16], amax FP32 (1,) or (R,),
    and the global-scale bound B it was quantized with."""

    data: np.ndarray
    scale: np.ndarray
    amax: np.ndarray
    bound: int = E4M3_LARGEST

    def decoded_blocks(self) -> np.ndarray:
        """fp4(q) * fp32(s_b) per element, float64 [R, C] (exact)."""
        values = E2M1[unpack(self.data)]
        return values * np.repeat(E4M3[self.scale], BLOCK, axis=1)

    def decode_scales(self) -> np.ndarray:
        """S_dec per tensor (1,) or per row (R,), float64."""
        return decode_scale(self.amax, self.bound).astype(np.float64)

    def decoded(self) -> np.ndarray:
        """fp4(q) * s_b * S_dec, float64 [R, C] (exact: at most 6 + 24 significant bits)."""
        return self.decoded_blocks() * self.decode_scales().reshape(-1, 1)

    def torch(self) -> tuple:
        """(data, scale, amax) as torch tensors (uint8, float8_e4m3fn, float32)."""
        return (torch.from_numpy(self.data.copy()), torch.from_numpy(self.scale.copy()).view(torch.float8_e4m3fn),
                torch.from_numpy(self.amax.astype(F32).copy()))


def copy_of(q, copy: str) -> Copy:
    """One copy ('rowwise' or 'columnwise') of an nvfp4_dist.NVFP4Tensor, as the bytes it holds."""
    data, scale, amax = (getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}"))
    return Copy(data.cpu().numpy(), scale.cpu().view(torch.uint8).numpy(), amax.cpu().numpy().astype(F32),
                int(q.e4m3_bound))


def amax_of(x2d: np.ndarray, per_row: bool = False) -> np.ndarray:
    a = np.abs(x2d.astype(F32))
    return (a.max(axis=1) if per_row else a.max().reshape(1)).astype(F32)


def quantize_blocks(x2d: np.ndarray, amax: np.ndarray, *, block_2d: bool = False, sr_seed: int | None = None,
                    first_row: int = 0, first_col: int = 0, stream: int = 0, s_enc: np.ndarray | None = None) -> Copy:
    """One copy of x [R, C] quantized along C (1x16 blocks, or 16x16 tiles), amax (1,) or (R,) per row.

    SR (sr_seed): the element at (r, c) draws the byte of global position (first_row + r, first_col + c).
    s_enc: a global encode scale to use instead of encode_scale(amax) (to show that a test input tells a wrong
    one apart).
    """
    x = np.asarray(x2d, dtype=F32)
    rows, cols = x.shape
    amax = np.asarray(amax, dtype=F32).reshape(-1)
    s_enc = (encode_scale(amax) if s_enc is None else np.asarray(s_enc, dtype=F32)).reshape(-1, 1)
    s_dec = (F32(1) / s_enc).astype(F32)
    magnitude = np.abs(x).reshape(rows, cols // BLOCK, BLOCK)
    if block_2d:
        tiles = np.abs(x).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).max(axis=(1, 3))
        block_amax = np.repeat(tiles, BLOCK, axis=0)
    else:
        block_amax = magnitude.max(axis=2)
    factor = (s_enc * (F32(1) / F32(6))).astype(F32)          # S_enc * fp32(1/6), then a_b times that
    with np.errstate(over="ignore"):
        product = np.minimum(block_amax.astype(F32) * factor, FLT_MAX)
    scale = encode_e4m3(np.clip(product, F32(-448), F32(448)).astype(F32))
    with np.errstate(divide="ignore", over="ignore"):
        encode = np.minimum(F32(1) / (E4M3[scale].astype(F32) * s_dec), FLT_MAX).astype(F32)
        scaled = np.clip(x.reshape(rows, cols // BLOCK, BLOCK) * encode[:, :, None], F32(-6), F32(6))
    scaled = scaled.reshape(rows, cols).astype(F32)
    if sr_seed is None:
        codes = encode_e2m1(scaled)
    else:
        positions = (np.arange(rows)[:, None] + first_row, np.arange(cols)[None, :] + first_col)
        codes = stochastic_e2m1(scaled, sr_bytes(*positions, stream, sr_seed))
    return Copy(pack(codes), scale, amax.copy())


@dataclasses.dataclass(frozen=True)
class FourOverSix:
    """4over6 settings of one tensor (docs/numerics.md §12): the error measure ("MAE" or "MSE"), the global-scale
    bound B (256 or 448), and whether the error is measured in the scaled domain (fast_math)."""

    err_mode: str = "MAE"
    bound: int = 256
    fast_math: bool = False


def quantize_blocks_4over6(x2d: np.ndarray, amax: np.ndarray, options: FourOverSix, *, block_2d: bool = False) -> Copy:
    """One copy of x [R, C] with 4over6 (docs/numerics.md §12): each block quantized with its max mapped to 6 and to
    4, the candidate whose error is smaller kept (ties keep map-to-6); amax (1,) or (R,) per row."""
    x = np.asarray(x2d, dtype=F32)
    rows, cols = x.shape
    amax = np.asarray(amax, dtype=F32).reshape(-1)
    s_enc = encode_scale(amax, options.bound).reshape(-1, 1)                       # step 1
    s_dec = (F32(1) / s_enc).astype(F32)
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    if block_2d:
        tiles = np.abs(x).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).max(axis=(1, 3))
        block_amax = np.repeat(tiles, BLOCK, axis=0)
    else:
        block_amax = np.abs(blocks).max(axis=2)
    with np.errstate(over="ignore", invalid="ignore"):
        base = ((block_amax.astype(F32) / F32(6)) * s_enc).astype(F32)            # step 2: divide first
        scales = {4: encode_e4m3(np.clip((base * F32(1.5)).astype(F32), F32(0), F32(448))),
                  6: encode_e4m3(np.clip(base, F32(0), F32(448)))}
    candidates = {}
    for mapped, scale in scales.items():
        scale_value = E4M3[scale].astype(F32)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            encode = np.minimum(F32(1) / (scale_value * s_dec), FLT_MAX).astype(F32)  # step 3
            scaled = np.clip(blocks * encode[:, :, None], F32(-6), F32(6)).astype(F32)
            codes = encode_e2m1(scaled)
            products = (E2M1[codes].astype(F32) * scale_value[:, :, None]).astype(F32)  # exact
            if options.fast_math:                                                       # step 4
                differences = products - (blocks * s_enc[:, :, None]).astype(F32)
            else:
                row_amax = amax.reshape(-1, 1, 1)
                differences = ((products * row_amax).astype(F32) / F32(6 * options.bound)).astype(F32) - blocks
            differences = differences.astype(F32)
            error = np.zeros(block_amax.shape, dtype=F32)
            for i in range(BLOCK):
                d = differences[:, :, i]
                error = (error + (d * d if options.err_mode == "MSE" else np.abs(d))).astype(F32)
        if block_2d:                                                                    # step 5: tile tree sum
            tile = error.reshape(rows // BLOCK, BLOCK, cols // BLOCK)
            half = BLOCK // 2
            while half >= 1:
                tile = (tile[:, :half] + tile[:, half:2 * half]).astype(F32)
                half //= 2
            error = np.repeat(tile[:, 0], BLOCK, axis=0)
        candidates[mapped] = (codes, scale, error)
    pick_4 = candidates[4][2] < candidates[6][2]                                          # step 6
    codes = np.where(pick_4[:, :, None], candidates[4][0], candidates[6][0]).reshape(rows, cols)
    scale = np.where(pick_4, candidates[4][1], candidates[6][1]).astype(np.uint8)
    return Copy(pack(codes.astype(np.uint8)), scale, amax.copy(), options.bound)


def as_float32(x) -> np.ndarray:
    """A tensor's values as a float32 [M, K] array (exact for BF16, FP16 and FP32)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x, dtype=F32)
    return x.reshape(-1, x.shape[-1])


@dataclasses.dataclass
class Quantized:
    rowwise: Copy | None
    columnwise: Copy | None


def quantize(x, *, rowwise: bool = True, columnwise: bool = True, block_2d: bool = False, rht: bool = False,
             random_sign: bool = True, row_scaled: bool = False, sr_seed: int | None = None, first_row: int = 0,
             amax_rowwise=None, amax_columnwise=None, four_over_six: FourOverSix | None = None) -> Quantized:
    """The rowwise copy of x [M, K] and the columnwise copy of x^T [K, M] (after the RHT when asked; x must hold
    BF16 values then), as docs/numerics.md §3 defines them.

    row_scaled: one amax per row of each copy's own 2D view: per token for the rowwise copy (§6), per row of x^T
    (column of x, after the RHT) for the columnwise copy (§6b).
    first_row: x's first row in the global tensor (a shard), for the SR positions: rowwise (first_row + m, k),
    columnwise (k, first_row + m). amax_*: given from outside (reduced over ranks), else computed here.
    four_over_six: 4over6 block scaling of both copies (§12); not with SR.
    """
    x2d = as_float32(x)

    def one_copy(source, given_amax, first, stream):
        amax = amax_of(source, per_row=row_scaled) if given_amax is None else np.asarray(given_amax, F32)
        if four_over_six is not None:
            return quantize_blocks_4over6(source, amax, four_over_six, block_2d=block_2d)
        return quantize_blocks(source, amax, block_2d=block_2d, sr_seed=sr_seed, first_row=first[0],
                               first_col=first[1], stream=stream)
    row = one_copy(x2d, amax_rowwise, (first_row, 0), ROWWISE_STREAM) if rowwise else None
    col = None
    if columnwise:
        source = rht_columnwise_source(x2d, random_sign) if rht else x2d.T
        col = one_copy(source, amax_columnwise, (0, first_row), COLUMNWISE_STREAM)
    return Quantized(row, col)


# ------------------------------------------------------------------------------------------------------
# Float64 GEMM of decoded copies, and what an FP32-accumulating GEMM may differ from it by.

@dataclasses.dataclass
class Product:
    """A . B^T of two copies quantized along K: the float64 value, and the elementwise sum of |terms|."""

    value: np.ndarray
    magnitude: np.ndarray
    blocks: int  # K / 16: the FP32 partial sums a GEMM adds

    def bound(self, out_dtype: torch.dtype, bias=None) -> np.ndarray:
        """Largest |y - value - bias| of a GEMM that sums exact per-block FP32 partials in any order, scales by
        the FP32 product of the two S_dec, adds the bias in FP32 and rounds to out_dtype: (blocks + 3) FP32
        roundings of the magnitude (sum, alpha, scaling, bias), plus half a BF16 (or FP16) step of the result."""
        bias_magnitude = 0.0 if bias is None else np.abs(as_float32(bias).reshape(1, -1)).astype(np.float64)
        fp32 = (self.blocks + 3) * FP32_UNIT_ROUNDOFF * (self.magnitude + bias_magnitude)
        if out_dtype == torch.float32:
            return fp32
        unit = BF16_UNIT_ROUNDOFF if out_dtype == torch.bfloat16 else 2.0 ** -11
        total = np.abs(self.value + (0.0 if bias is None else as_float32(bias).reshape(1, -1)))
        return unit * (total + fp32) + fp32


def product(a: Copy, b: Copy) -> Product:
    """A . B^T in float64 from the decoded bytes: block values multiplied and summed exactly, times the two S_dec."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"K mismatch: {a.data.shape} and {b.data.shape} (packed)")
    a_blocks, b_blocks = a.decoded_blocks(), b.decoded_blocks()
    alpha = a.decode_scales().reshape(-1, 1) * b.decode_scales().reshape(1, -1)
    return Product(value=(a_blocks @ b_blocks.T) * alpha, magnitude=(np.abs(a_blocks) @ np.abs(b_blocks).T) * alpha,
                   blocks=a.data.shape[1] * 2 // BLOCK)


# The GPU GEMM backends (Hopper: exact BF16 block values on tensor cores; Blackwell: cuBLASLt block-scaled NVFP4)
# multiply the same exact block products as the reference and accumulate in FP32, but in another order and with the
# tensor cores' own alignment of partial sums, not IEEE adds. This allows their sum 12 correct bits of the sum of
# |terms| (IEEE FP32 in any order needs K * 2^-24 of it; one wrong term of typical size moves a result by ~1/K).
TENSOR_CORE_ACCUMULATION = 2.0 ** -12


def backend_difference_bound(expected: np.ndarray, magnitude: np.ndarray, unit: float = BF16_UNIT_ROUNDOFF):
    """Largest |y_a - y_b| of two GEMM backends on the same operands, each rounded to a format of unit roundoff
    `unit`: both roundings (2 * unit * |y|) and the accumulation allowance on the sum of |terms| (`magnitude`)."""
    return 2 * unit * (1 + unit) * np.abs(expected) + (1 + 2 * unit) * TENSOR_CORE_ACCUMULATION * magnitude


def sum_bound(values: list, bounds: list, unit: float = BF16_UNIT_ROUNDOFF) -> tuple:
    """The float64 sum of t partial results (each already within its bound of its value) and the bound of any
    order of t - 1 additions rounded to a format with unit roundoff `unit` (BF16 all-reduce, reduce-scatter or ring)."""
    total = np.sum(values, axis=0)
    reach = np.sum([np.abs(v) + e for v, e in zip(values, bounds)], axis=0)
    return total, np.sum(bounds, axis=0) + (len(values) - 1) * unit * reach * (1 + unit) ** len(values)


def check_within(name: str, got, value: np.ndarray, bound: np.ndarray) -> None:
    """Assert |got - value| <= bound elementwise, naming the worst element."""
    got = as_float32(got).astype(np.float64).reshape(value.shape)
    if not np.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values")
    excess = np.abs(got - value) - bound
    if (excess > 0).any():
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        raise AssertionError(f"{name}: {int((excess > 0).sum())} of {excess.size} elements outside the bound; worst "
                             f"{worst}: got {got[worst]:.9g}, oracle {value[worst]:.9g}, |diff| "
                             f"{abs(got[worst] - value[worst]):.3g} > bound {bound[worst]:.3g}")


def check_copy(name: str, data, scale, amax, expected: Copy) -> None:
    """Assert a copy's bytes (packed data, scale bytes, amax) equal the oracle's."""
    got = (np.asarray(data.cpu()), np.asarray(scale.cpu().view(torch.uint8)), np.asarray(amax.cpu(), dtype=F32))
    for field, mine, theirs in zip(("data", "scale", "amax"), got, (expected.data, expected.scale, expected.amax)):
        mine = mine.reshape(theirs.shape) if mine.size == theirs.size else mine
        if mine.shape != theirs.shape:
            raise AssertionError(f"{name} {field}: shape {mine.shape} != oracle {theirs.shape}")
        differ = mine.view(np.uint8) != theirs.view(np.uint8) if field != "amax" else mine != theirs
        if differ.any():
            where = np.argwhere(differ)[:3].tolist()
            raise AssertionError(f"{name} {field}: {int(differ.sum())} entries differ from the oracle, e.g. at {where}")
