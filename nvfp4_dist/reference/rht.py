"""Random Hadamard transform of the wgrad operands (docs/numerics.md section 5)."""
import torch

from nvfp4_dist.formats import BLOCK_SIZE

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard_16() -> torch.Tensor:
    """16 x 16 Sylvester Hadamard matrix (entries +-1), FP32."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(random_sign: bool = True) -> torch.Tensor:
    """H = diag(s) . H16 / 4 (or plain H16 / 4), orthogonal, FP32."""
    h = hadamard_16() / 4
    if random_sign:
        h = torch.tensor(RHT_SIGNS, dtype=torch.float32)[:, None] * h
    return h


def hadamard_butterflies(t: torch.Tensor) -> torch.Tensor:
    """t . H16 on the last dim (16) of an FP32 tensor, by the fast Walsh-Hadamard transform: butterflies
    (a, b) -> (a + b, a - b) on the pairs (i, i + h), i & h == 0, for h = 1, 2, 4, 8 in turn.

    This order of the FP32 additions defines the RHT's rounding (docs/numerics.md §5 fixes only FP32); the kernels
    add in the same order (csrc/nvfp4_numerics.cuh), and elementwise additions round the same on any
    device, unlike a matmul, whose order depends on the BLAS.
    """
    lead = t.shape[:-1]
    h = 1
    while h < BLOCK_SIZE:
        pairs = t.reshape(*lead, BLOCK_SIZE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        t = torch.stack((a + b, a - b), dim=-2).reshape(*lead, BLOCK_SIZE)
        h *= 2
    return t


def _signs(random_sign: bool, device) -> torch.Tensor:
    return torch.tensor(RHT_SIGNS if random_sign else (1,) * BLOCK_SIZE, dtype=torch.float32, device=device)


def rht_chunks(chunks: torch.Tensor, random_sign: bool = True) -> torch.Tensor:
    """c . H for FP32 16-chunks c (last dim) of BF16 values: terms c_i * (s_i / 4) + 0 (exact; the + 0
    turns -0.0 into +0.0), then hadamard_butterflies. FP32 out."""
    return hadamard_butterflies(chunks * (_signs(random_sign, chunks.device) / 4) + 0.0)


def inverse_rht_chunks(y: torch.Tensor, random_sign: bool = True) -> torch.Tensor:
    """y . H^T for FP32 16-chunks y (last dim): terms y_j * (1/4) + 0 (rounded), hadamard_butterflies,
    then output i times s_i, as 0 - sum where s_i = -1. FP32 out."""
    sums = hadamard_butterflies(y * 0.25 + 0.0)
    return torch.where(_signs(random_sign, y.device) < 0, 0.0 - sums, sums)


def rht_transpose(x2d: torch.Tensor, random_sign: bool = True) -> torch.Tensor:
    """x [M, K] -> (x^T with each 16-chunk along M multiplied by H) [K, M], rounded to BF16.

    Computed in FP32 from a BF16 input (docs/numerics.md §5) by rht_chunks; M must be a multiple of 16.
    """
    if x2d.dtype != torch.bfloat16:
        raise ValueError(f"RHT input dtype={x2d.dtype}: the RHT path takes torch.bfloat16 only")
    rows, cols = x2d.shape
    chunks = x2d.t().to(torch.float32).reshape(cols, rows // BLOCK_SIZE, BLOCK_SIZE)
    return rht_chunks(chunks, random_sign).reshape(cols, rows).to(torch.bfloat16)


def inverse_rht_transpose(y_t: torch.Tensor, random_sign: bool = True) -> torch.Tensor:
    """Undo rht_transpose in FP32: [K, M] transformed -> [M, K] (H is orthogonal)."""
    cols, rows = y_t.shape
    chunks = y_t.to(torch.float32).reshape(cols, rows // BLOCK_SIZE, BLOCK_SIZE)
    return inverse_rht_chunks(chunks, random_sign).reshape(cols, rows).t()
