"""Block-scaled NVFP4 GEMM (docs/numerics.md §8): y = A . B^T, both operands quantized along K.

dispatch: validation and backend choice (the public `gemm`); gpu_backends: the two GPU backends' entry and the
shared output epilogue; blackwell: cuBLASLt block-scaled FP4 (sm_100+); hopper: exact block emulation (sm_90,
needs Triton; imported only when that backend runs).
"""
from nvfp4_dist.gemm.dispatch import OUT_DTYPES, gemm, operand, resolve_backend

__all__ = ["OUT_DTYPES", "gemm", "operand", "resolve_backend"]
