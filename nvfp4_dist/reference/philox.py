"""Philox4x32 counter-based generator in plain torch (docs/numerics.md section 7).

Stochastic rounding draws its bits from Philox4x32-7 (7 rounds, which pass TestU01's BigCrush
in the Random123 paper; curand's Philox4_32_10 has 10). The CUDA kernels use the same generator,
so the reference and the kernels draw identical bits: SR output is reproducible byte for
byte from (seed, position), on any device and under any sharding.
"""
import torch

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57   # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85   # key schedule (Weyl) increments
CURAND_ROUNDS = 10              # curand's Philox4_32_10 (Random123's known-answer vectors)
SR_ROUNDS = 7                   # the stochastic-rounding bits


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of the 64-bit product a * b, in int64 without overflow."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    low_part = a * b_lo                      # < 2^48
    high_part = a * b_hi                     # < 2^48, weighs 2^16
    mid = low_part + ((high_part & 0xFFFF) << 16)  # < 2^49
    lo = mid & _MASK32
    hi = (high_part >> 16) + (mid >> 32)
    return hi & _MASK32, lo


def philox4x32(counter, key, rounds: int = CURAND_ROUNDS):
    """Philox4x32 with `rounds` rounds of 4 counter words (int64 tensors holding uint32) and 2 key ints.

    Returns 4 int64 tensors of uint32 words; with 10 rounds the same as curand's Philox4_32_10.
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


COLUMNS_PER_CALL = 16  # one Philox4x32-7 call (4 words of 32 bits) serves 16 columns, 8 bits each


def _select_bits(words, cols: torch.Tensor) -> torch.Tensor:
    """The comparison value of column `cols` from its group's 4 Philox words: byte (col % 16) % 4 of
    word (col % 16) // 4, times 256."""
    in_group = cols % COLUMNS_PER_CALL
    word_index = in_group // 4
    word = torch.where(word_index == 0, words[0],
                       torch.where(word_index == 1, words[1], torch.where(word_index == 2, words[2], words[3])))
    return ((word >> (8 * (in_group % 4))) & 0xFF) << 8


def _key(seed: int):
    return seed & _MASK32, (seed >> 32) & _MASK32


def stochastic_rounding_bits(rows: torch.Tensor, cols: torch.Tensor, stream: int, seed: int) -> torch.Tensor:
    """The random comparison values (int64 in [0, 65536), multiples of 256) of elements at global
    (row, col) of a copy: 8 random bits each, times 256, so the rule `bits < p * 65536` of
    reference/quantize.py rounds up in magnitude iff byte < p * 256.

    One Philox4x32-7 call serves 16 consecutive columns: counter = (col // 16, row, stream, 0),
    key = (seed low word, seed high word); column col uses byte (col % 16) % 4 (bits 8 * that and up)
    of word (col % 16) // 4.
    """
    words = philox4x32((cols // COLUMNS_PER_CALL, rows, torch.full_like(rows, stream), torch.zeros_like(rows)),
                       _key(seed), SR_ROUNDS)
    return _select_bits(words, cols)


def stochastic_rounding_bits_grid(num_rows: int, num_cols: int, row_offset: int, col_offset: int, stream: int,
                                  seed: int, device=None) -> torch.Tensor:
    """stochastic_rounding_bits of the [num_rows, num_cols] block at (row_offset, col_offset), one Philox call per
    row and group of 16 columns rather than per element."""
    rows = torch.arange(num_rows, dtype=torch.int64, device=device)[:, None] + row_offset
    cols = torch.arange(num_cols, dtype=torch.int64, device=device) + col_offset
    first_group = col_offset // COLUMNS_PER_CALL
    groups = torch.arange(first_group, (col_offset + num_cols - 1) // COLUMNS_PER_CALL + 1, dtype=torch.int64,
                          device=device)
    rows, groups = torch.broadcast_tensors(rows, groups[None, :])
    words = philox4x32((groups, rows, torch.full_like(rows, stream), torch.zeros_like(rows)), _key(seed), SR_ROUNDS)
    group_of_col = cols // COLUMNS_PER_CALL - first_group
    return _select_bits([w[:, group_of_col] for w in words], cols[None, :])
