"""nvfp4-dist: NVFP4 training under tensor and sequence parallelism."""
import logging

from . import formats, reference
from .autocast import autocast
from .finite_check import NonFiniteAmaxError, raise_pending_nonfinite
from .gemm import gemm
from .linear import Linear
from .ops import compute_amaxes, dequantize, quantize, swap_first_dims, swizzle_scales
from .recipe import NVFP4Recipe
from .tensor import NVFP4Tensor

logging.getLogger("nvfp4_dist").addHandler(logging.NullHandler())

__all__ = ["NonFiniteAmaxError", "autocast", "Linear", "NVFP4Recipe", "NVFP4Tensor", "compute_amaxes", "dequantize",
           "formats", "gemm", "quantize", "raise_pending_nonfinite", "reference", "swap_first_dims", "swizzle_scales"]
