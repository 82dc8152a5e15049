"""The pure-torch reference: the SPEC in code. Every CUDA kernel has its twin here."""
from .copies import compute_amaxes, dequantize_tensor, quantize_tensor
from .dequantize import dequantize_blocks
from .gemm import gemm_reference
from .philox import philox4x32, stochastic_rounding_bits, stochastic_rounding_bits_grid
from .quantize import compute_amax, compute_row_amax, decode_scale, encode_scale, quantize_blocks
from .rht import (hadamard_16, hadamard_butterflies, inverse_rht_chunks, inverse_rht_transpose, rht_chunks, rht_matrix,
                  rht_transpose)
from .swizzle import padded_scale_shape, swizzle_offset, swizzle_scales, unswizzle_scales
from .swap import swap_first_dims
