"""nvfp4-dist: NVFP4 training under tensor and sequence parallelism."""
import logging

from nvfp4_dist import formats, reference
from nvfp4_dist.autocast import autocast
from nvfp4_dist.finite_check import NonFiniteAmaxError, raise_pending_nonfinite
from nvfp4_dist.gemm import gemm
from nvfp4_dist.graphs import make_graphed_callables
from nvfp4_dist.grouped_linear import GroupedLinear
from nvfp4_dist.layernorm_linear import LayerNormLinear, LayerNormMLP
from nvfp4_dist.linear import Linear, name_layers
from nvfp4_dist.ops import compute_amaxes, dequantize, quantize, swap_first_dims, swizzle_scales
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap
from nvfp4_dist.tensor import NVFP4Tensor

logging.getLogger("nvfp4_dist").addHandler(logging.NullHandler())

__all__ = ["NonFiniteAmaxError", "autocast", "GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear", "NVFP4Recipe",
           "NVFP4Tensor", "RecipeMap", "compute_amaxes", "dequantize", "formats", "gemm", "make_graphed_callables",
           "name_layers", "quantize",
           "raise_pending_nonfinite", "reference", "swap_first_dims", "swizzle_scales"]
