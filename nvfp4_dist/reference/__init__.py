"""The pure-torch reference: docs/numerics.md in code. Every CUDA kernel has its twin here."""
from nvfp4_dist.reference.copies import compute_amaxes, dequantize_tensor, quantize_tensor
from nvfp4_dist.reference.dequantize import dequantize_blocks
from nvfp4_dist.reference.gemm import gemm_reference
from nvfp4_dist.reference.philox import philox4x32, stochastic_rounding_bits, stochastic_rounding_bits_grid
from nvfp4_dist.reference.quantize import compute_amax, compute_row_amax, decode_scale, encode_scale, quantize_blocks
from nvfp4_dist.reference.rht import (hadamard_16, hadamard_butterflies, inverse_rht_chunks, inverse_rht_transpose,
                                     rht_chunks, rht_matrix, rht_transpose)
from nvfp4_dist.reference.swizzle import padded_scale_shape, swizzle_offset, swizzle_scales, unswizzle_scales
from nvfp4_dist.reference.swap import swap_first_dims, transpose_codes
