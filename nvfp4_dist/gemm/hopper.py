"""Hopper (sm_90) NVFP4 GEMM by exact block emulation (docs/numerics.md §8).

Every FP4 value times its E4M3 block scale has at most 6 significant bits, so it is
exact in FP16 and BF16, and tensor-core products of such values are exact in FP32.

Dequantization trick: the E2M1 bits (s, e1, e0, m) placed as the E4M3 byte
s 0 0 e1 e0 m 0 0 encode exactly fp4value * 2^-6 (E4M3 subnormals cover the 0.5 code),
so the hardware E4M3 -> FP16 conversion does the decoding. Products with the block
scale, fp4 * scale * 2^-6, lie in [2^-16, 42] with at most 6 significant bits: exact
in FP16. The fused GEMM feeds those FP16 tiles to the tensor cores and multiplies the
FP32 accumulator by 2^12 * alpha in the epilogue. alpha = S_dec(a) * S_dec(b) is computed
inside the kernels from the amax tensors (no host sync, no extra launches).

Two paths:
- gemm_fused: dequantization inside the GEMM's K loop (packed tiles loaded, decoded in
  registers, tl.dot with FP32 accumulation); no operand copy is materialised.
- gemm_dequantize_matmul: a dequantize kernel writes BF16 operands and cuBLASLt multiplies
  them, scaling by alpha read from device memory and writing the output dtype itself
  (csrc/cublaslt_gemm.cu); where it cannot (row-scaled A, ...), cuBLAS writes the FP32
  product and an epilogue kernel applies alpha/bias/accumulate (csrc/gemm_epilogue.cu). The
  kernels are CUDA, not Triton: a C++ launch costs a few microseconds of host time where
  Triton's Python launcher costs tens. The BF16 copy of B is kept for the next call while
  that call's B is the same, unmodified tensor: the overlapped layers' per-chunk GEMMs
  (parallel/overlap.py) dequantize their weight once.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from nvfp4_dist._extension import load_extension, stream_handle
from nvfp4_dist.formats import E4M3_BOUND, FP4_MAX


# E4M3-packed FP4 values carry 2^-6 each; a product of two carries 2^-12.
_OPERAND_EXPONENT_CORRECTION = tl.constexpr(4096.0)
_FP16_OPERAND_FACTOR = 2.0 ** -6  # FP16 operands hold fp4 * scale * 2^-6, as the fused kernel decodes them

# PTX for one 32-bit word of 8 packed FP4 codes and its FP16 block scale -> 8 FP16 values
# fp4 * scale * 2^-6 in element order. $0..$7 outputs, $8 the word, $9 the scale.
_DEQUANTIZE_WORD_PTX = tl.constexpr("""
{
.reg .b32 lo, hi, t0, t1, s2;
.reg .b16 l0, l1, h0, h1;
and.b32 t0, $8, 0x07070707;
shl.b32 t0, t0, 2;
and.b32 t1, $8, 0x08080808;
shl.b32 t1, t1, 4;
or.b32 lo, t0, t1;
shr.b32 t0, $8, 2;
and.b32 t0, t0, 0x1C1C1C1C;
and.b32 t1, $8, 0x80808080;
or.b32 hi, t0, t1;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
mov.b32 s2, {$9, $9};
cvt.rn.f16x2.e4m3x2 t0, l0;
mul.rn.f16x2 t0, t0, s2;
mov.b32 {$0, $2}, t0;
cvt.rn.f16x2.e4m3x2 t0, l1;
mul.rn.f16x2 t0, t0, s2;
mov.b32 {$4, $6}, t0;
cvt.rn.f16x2.e4m3x2 t0, h0;
mul.rn.f16x2 t0, t0, s2;
mov.b32 {$1, $3}, t0;
cvt.rn.f16x2.e4m3x2 t0, h1;
mul.rn.f16x2 t0, t0, s2;
mov.b32 {$5, $7}, t0;
}
""")


@triton.jit
def _decode_scale(amax, numerator):
    """S_dec = 1 / S_enc with S_enc = min(numerator / amax, FLT_MAX), 1 where that is 0 (docs/numerics.md §2.2;
    numerator 6 B: 2688, or 1536 for 4over6 tensors with the bound 256, §12.7): the reference's two correctly
    rounded FP32 divisions."""
    s_enc = tl.math.div_rn(tl.zeros_like(amax) + numerator, amax)
    s_enc = tl.minimum(s_enc, 3.4028234663852886e38)
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
    return tl.math.div_rn(tl.zeros_like(s_enc) + 1.0, s_enc)


@triton.jit
def _alpha(a_amax_ptr, b_amax_ptr, rows, row_mask, cols, a_numerator, b_numerator, ALPHA_PER_ROW: tl.constexpr,
           ALPHA_PER_COL: tl.constexpr):
    """FP32 alpha = S_dec(a) * S_dec(b): S_dec(a) a column [rows, 1] when A is row-scaled, S_dec(b) a row [1, cols]
    when B holds one amax per row (the columnwise copy of a row-scaled activation, docs/numerics.md §6b)."""
    if ALPHA_PER_ROW:
        a_s_dec = _decode_scale(tl.load(a_amax_ptr + rows, mask=row_mask, other=1.0), a_numerator)[:, None]
    else:
        a_s_dec = _decode_scale(tl.load(a_amax_ptr), a_numerator)
    if ALPHA_PER_COL:
        b_s_dec = _decode_scale(tl.load(b_amax_ptr + cols), b_numerator)[None, :]
    else:
        b_s_dec = _decode_scale(tl.load(b_amax_ptr), b_numerator)
    return a_s_dec * b_s_dec


@triton.jit
def _byte_to_f16_pair(byte, scale):
    """Both FP4 codes of each byte (int32 in 0..255) as FP16 fp4 * scale * 2^-6: (low, high)."""
    low = (((byte & 0x7) << 2) | ((byte & 0x8) << 4)).to(tl.uint8)
    high = (((byte >> 2) & 0x1C) | (byte & 0x80)).to(tl.uint8)
    low = low.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale
    high = high.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale
    return low, high


@triton.jit
def _dequantize_words(words, scale, ROWS: tl.constexpr, WORDS: tl.constexpr, USE_PTX: tl.constexpr):
    """int32 [ROWS, WORDS] of packed FP4, FP16 scale per word -> FP16 [ROWS, 8 * WORDS] = fp4 * scale * 2^-6."""
    if USE_PTX:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _DEQUANTIZE_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scale],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16,
                   tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    else:
        v0, v1 = _byte_to_f16_pair(words & 0xFF, scale)
        v2, v3 = _byte_to_f16_pair((words >> 8) & 0xFF, scale)
        v4, v5 = _byte_to_f16_pair((words >> 16) & 0xFF, scale)
        v6, v7 = _byte_to_f16_pair((words >> 24) & 0xFF, scale)
    # Nested joins whose flattening is element order 0..7 (the last join picks the lowest index bit).
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.join(even, odd).reshape(ROWS, 8 * WORDS)


@triton.jit
def _word_scales(scale_bytes, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """E4M3 scale bytes [ROWS, WORDS/2] (one per 16-element block) -> FP16 [ROWS, WORDS], one per word."""
    scale = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.join(scale, scale).reshape(ROWS, WORDS)


@triton.jit
def _nvfp4_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, a_amax_ptr, b_amax_ptr, bias_ptr, out_ptr,
                       M, N, K_WORDS, stride_a, stride_a_scale, stride_b, stride_b_scale, stride_out,
                       a_numerator, b_numerator, ALPHA_PER_ROW: tl.constexpr, ALPHA_PER_COL: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                       EVEN_K: tl.constexpr, USE_PTX: tl.constexpr, B_DEQUANTIZED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    """out[M, N] (+)= (A . B^T) * 2^12 * alpha (+ bias), A and B packed FP4 [rows, K/8] int32 words.

    B_DEQUANTIZED: b_ptr holds B already decoded, FP16 [N, K] = fp4 * scale * 2^-6 (b_scale_ptr unused).
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    SCALES: tl.constexpr = BLOCK_K // 16
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows

    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    load_m = rows_m % M  # rows past the end recompute valid rows; their output is masked
    load_n = rows_n % N
    word = tl.arange(0, WORDS)
    block = tl.arange(0, SCALES)
    a_ptrs = a_ptr + load_m[:, None] * stride_a + word[None, :]
    a_scale_ptrs = a_scale_ptr + load_m[:, None] * stride_a_scale + block[None, :]
    if B_DEQUANTIZED:
        b_ptrs = b_ptr + load_n[:, None] * stride_b + tl.arange(0, BLOCK_K)[None, :]
    else:
        b_ptrs = b_ptr + load_n[:, None] * stride_b + word[None, :]
    b_scale_ptrs = b_scale_ptr + load_n[:, None] * stride_b_scale + block[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first_word in range(0, K_WORDS, WORDS):
        if EVEN_K:
            a_words = tl.load(a_ptrs)
            a_scale_bytes = tl.load(a_scale_ptrs)
        else:
            words_left = K_WORDS - first_word
            a_words = tl.load(a_ptrs, mask=word[None, :] < words_left, other=0)
            a_scale_bytes = tl.load(a_scale_ptrs, mask=block[None, :] < words_left // 2, other=0)
        a_vals = _dequantize_words(a_words, _word_scales(a_scale_bytes, BLOCK_M, WORDS), BLOCK_M, WORDS, USE_PTX)
        if B_DEQUANTIZED:
            if EVEN_K:
                b_vals = tl.load(b_ptrs)
            else:
                b_vals = tl.load(b_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < (K_WORDS - first_word) * 8, other=0.0)
        else:
            if EVEN_K:
                b_words = tl.load(b_ptrs)
                b_scale_bytes = tl.load(b_scale_ptrs)
            else:
                words_left = K_WORDS - first_word
                b_words = tl.load(b_ptrs, mask=word[None, :] < words_left, other=0)
                b_scale_bytes = tl.load(b_scale_ptrs, mask=block[None, :] < words_left // 2, other=0)
            b_vals = _dequantize_words(b_words, _word_scales(b_scale_bytes, BLOCK_N, WORDS), BLOCK_N, WORDS, USE_PTX)
        acc = tl.dot(a_vals, tl.trans(b_vals), acc)
        a_ptrs += WORDS
        b_ptrs += BLOCK_K if B_DEQUANTIZED else WORDS
        a_scale_ptrs += SCALES
        b_scale_ptrs += SCALES

    acc = acc * _OPERAND_EXPONENT_CORRECTION  # exact power of two
    acc = acc * _alpha(a_amax_ptr, b_amax_ptr, load_m, load_m < M, load_n, a_numerator, b_numerator, ALPHA_PER_ROW,
                       ALPHA_PER_COL)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + load_n).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows_m[:, None] * stride_out + rows_n[None, :]
    out_mask = (rows_m < M)[:, None] & (rows_n < N)[None, :]
    if ACCUMULATE:
        acc = acc + tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Tile shape and pipelining of the fused kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    use_ptx: bool = True
    dequantize_b_first: bool = False  # decode B to FP16 in a separate pass, only A inside the GEMM


DEFAULT_FUSED_CONFIG = FusedConfig(dequantize_b_first=True)  # the fastest fused variant (benchmarks/gemm.py)
# gemm_dequantize_matmul's row chunks: at most this many bytes of BF16 A rows (and FP32 product rows) at once,
# so a large GEMM's temporaries stay small next to the activations (one pass when they fit; chunks cost a
# little time, `benchmarks/gemm.py --sweep` measures it).
CHUNK_BYTES = 512 << 20


def packed_words(data: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, K/2] packed FP4 -> int32 [rows, K/8] (8 codes a word), a view."""
    if data.stride(1) != 1 or data.stride(0) % 4 or data.storage_offset() % 4:
        data = data.contiguous()
    return data.view(torch.int32)


def output_tensor(rows: int, cols: int, out_dtype: torch.dtype, accumulate_into, out, device) -> torch.Tensor:
    """Where y goes: accumulate_into, else the caller's out, else a new tensor."""
    if accumulate_into is not None:
        return accumulate_into
    if out is not None:
        return out
    return torch.empty(rows, cols, dtype=out_dtype, device=device)


def gemm_fused(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, out_dtype=torch.float32, bias=None,
               accumulate_into=None, out=None, config: FusedConfig = DEFAULT_FUSED_CONFIG,
               a_e4m3_bound: int = E4M3_BOUND, b_e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """y = A . B^T with dequantization fused into the GEMM; returns accumulate_into or out when given.
    a_amax: 1 or M values; b_amax: 1 or N values; *_e4m3_bound: each operand's global-scale bound."""
    rows, cols, k_words = a_data.shape[0], b_data.shape[0], a_data.shape[1] // 4
    a_words, a_scale = packed_words(a_data), a_scale.contiguous().view(torch.uint8)
    if config.dequantize_b_first:
        b_operand = torch.empty(cols, k_words * 8, dtype=torch.float16, device=b_data.device)
        dequantize_into(b_data, b_scale, b_operand)
        b_scale = a_scale  # unused by the kernel
    else:
        b_operand, b_scale = packed_words(b_data), b_scale.contiguous().view(torch.uint8)
    a_amax, b_amax = a_amax.contiguous(), b_amax.contiguous()
    out = output_tensor(rows, cols, out_dtype, accumulate_into, out, a_data.device)
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(cols, config.block_n),)
    _nvfp4_gemm_kernel[grid](
        a_words, a_scale, b_operand, b_scale, a_amax, b_amax, bias if bias is not None else a_amax, out,
        rows, cols, k_words, a_words.stride(0), a_scale.stride(0), b_operand.stride(0), b_scale.stride(0),
        out.stride(0), FP4_MAX * a_e4m3_bound, FP4_MAX * b_e4m3_bound,
        ALPHA_PER_ROW=a_amax.numel() != 1, ALPHA_PER_COL=b_amax.numel() != 1, HAS_BIAS=bias is not None, ACCUMULATE=accumulate_into is not None,
        EVEN_K=k_words % (config.block_k // 8) == 0, USE_PTX=config.use_ptx, B_DEQUANTIZED=config.dequantize_b_first,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def dequantize_into(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode packed FP4 [rows, K/2] with E4M3 scales [rows, K/16] into out [rows, K] (contiguous):
    BF16 out gets fp4 * scale, FP16 out gets fp4 * scale * 2^-6 (both exact; no global factor).
    One CUDA kernel of csrc/dequantize.cu (a C++ launch: a few microseconds of host time)."""
    factor = _FP16_OPERAND_FACTOR if out.dtype == torch.float16 else 1.0
    load_extension().dequantize_block_values(data.contiguous(), scale.contiguous().view(torch.uint8), factor, out,
                                             stream_handle(out.device))
    return out


def dequantize_to_bf16(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """BF16 [rows, K] = fp4 code value * E4M3 block scale (exact; the global factor is not applied)."""
    out = torch.empty(data.shape[0], data.shape[1] * 2, dtype=torch.bfloat16, device=data.device)
    return dequantize_into(data, scale, out)


class _LastDequantizedB:
    """The BF16 values of the last B operand, reused while B is the same tensor object at the same version.

    The copy is dropped as soon as B's data is freed (a gathered wgrad operand, say), so it never outlives
    its operand and adds nothing to the peak memory of what follows. Inside a CUDA graph capture nothing is
    cached or dropped: the graph dequantizes B itself (the eager copy is not in the graph), and a copy made in a
    capture lives in that graph's private memory pool, which a module-level cache must not keep (or free while
    another graph is being captured).
    """

    def __init__(self):
        self.key, self.values, self.finalizer = None, None, None

    def _forget(self, key) -> None:
        if self.key is key:
            self.key, self.values = None, None

    def cached(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """The copy of B when this cache holds it (never inside a capture), else None; caches nothing."""
        cached = self.key
        if (cached is None or cached[0]() is not data or cached[2]() is not scale or cached[1] != data._version
                or cached[3] != scale._version or torch.cuda.is_current_stream_capturing()):
            return None
        return self.values

    def get(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            return dequantize_to_bf16(data, scale)
        key = (weakref.ref(data), data._version, weakref.ref(scale), scale._version)
        if self.cached(data, scale) is None:
            if self.finalizer is not None:
                self.finalizer.detach()  # one finalizer per cached operand, however often B changes
            self.key, self.values = None, None  # drop the old copy before making the new one
            self.values = dequantize_to_bf16(data, scale)
            self.key = key
            self.finalizer = weakref.finalize(data, self._forget, key)
        return self.values


_last_b = _LastDequantizedB()


def apply_epilogue(acc: torch.Tensor, a_amax: torch.Tensor, b_amax: torch.Tensor, bias, out: torch.Tensor,
                   accumulate: bool, a_e4m3_bound: int = E4M3_BOUND, b_e4m3_bound: int = E4M3_BOUND) -> None:
    """out (+)= acc * S_dec(a_amax) * S_dec(b_amax) (+ bias), FP32 math, one pass (csrc/gemm_epilogue.cu); a_amax per
    row or per tensor, b_amax per column (B's rows) or per tensor."""
    load_extension().gemm_epilogue(acc, a_amax, b_amax, bias, accumulate, a_e4m3_bound, b_e4m3_bound, out,
                                   stream_handle(out.device))


def gemm_dequantize_matmul(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, out_dtype=torch.float32,
                           bias=None, accumulate_into=None, out=None, rows_per_chunk: int | None = None,
                           via_fp32: bool = False, a_e4m3_bound: int = E4M3_BOUND,
                           b_e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """y = A . B^T as dequantize-to-BF16 kernels and cuBLAS.

    cuBLASLt scales by alpha (read from the amaxes on the device) and writes y in its dtype, adding a bias
    of that dtype. Row-scaled A, B with one amax per row (docs/numerics.md §6b), a bias of another dtype, a bias
    with accumulate_into, via_fp32=True, or
    no cuBLASLt algorithm: cuBLAS writes the FP32 product and an epilogue kernel applies alpha, bias and
    accumulation (one more pass over the output). rows_per_chunk: run A in row chunks through reused
    buffers; None: as many rows as fit in CHUNK_BYTES (all of them for most GEMMs).
    """
    rows, cols = a_data.shape[0], b_data.shape[0]
    b_values = _last_b.get(b_data, b_scale)
    a_amax, b_amax = a_amax.contiguous(), b_amax.contiguous()
    out = output_tensor(rows, cols, out_dtype, accumulate_into, out, a_data.device)
    accumulate = accumulate_into is not None
    scaled_by_cublaslt = (not via_fp32 and a_amax.numel() == 1 and b_amax.numel() == 1
                          and (bias is None or (not accumulate and bias.dtype == out.dtype)))
    row_bytes = 2 * 2 * a_data.shape[1] + (0 if scaled_by_cublaslt else 4 * cols)  # BF16 A row (+ FP32 product row)
    chunk = min(rows, rows_per_chunk or max(256, CHUNK_BYTES // row_bytes // 256 * 256))
    a_values = torch.empty(chunk, a_data.shape[1] * 2, dtype=torch.bfloat16, device=a_data.device)
    acc = None
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        a_chunk = a_values[:stop - start]
        dequantize_into(a_data[start:stop], a_scale[start:stop], a_chunk)
        if scaled_by_cublaslt and load_extension().cublaslt_gemm(a_chunk, b_values, a_amax, b_amax, bias, accumulate,
                                                                 a_e4m3_bound, b_e4m3_bound, out[start:stop],
                                                                 stream_handle(out.device)):
            continue
        if acc is None:  # the FP32 path (or cuBLASLt has no algorithm for this chunk's problem)
            acc = torch.empty(chunk, cols, dtype=torch.float32, device=a_data.device)
        acc_chunk = acc[:stop - start]
        torch.mm(a_chunk, b_values.t(), out_dtype=torch.float32, out=acc_chunk)
        apply_epilogue(acc_chunk, a_amax[start:stop] if a_amax.numel() != 1 else a_amax, b_amax, bias,
                       out[start:stop], accumulate, a_e4m3_bound, b_e4m3_bound)
    return out
