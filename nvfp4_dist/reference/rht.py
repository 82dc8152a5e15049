"""Random Hadamard transform of the wgrad operands (SPEC section 5)."""
import torch

from ..formats import BLOCK_SIZE

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


def rht_transpose(x2d: torch.Tensor, random_sign: bool = True) -> torch.Tensor:
    """x [M, K] -> (x^T with each 16-chunk along M multiplied by H) [K, M], rounded to BF16.

    Computed in FP32 from a BF16 input (SPEC 5); M must be a multiple of 16.
    """
    if x2d.dtype != torch.bfloat16:
        raise ValueError(f"RHT input dtype={x2d.dtype}: the RHT path takes torch.bfloat16 only")
    rows, cols = x2d.shape
    chunks = x2d.t().to(torch.float32).reshape(cols, rows // BLOCK_SIZE, BLOCK_SIZE)
    h = rht_matrix(random_sign).to(x2d.device)
    return torch.matmul(chunks, h).reshape(cols, rows).to(torch.bfloat16)


def inverse_rht_transpose(y_t: torch.Tensor, random_sign: bool = True) -> torch.Tensor:
    """Undo rht_transpose in FP32: [K, M] transformed -> [M, K] (H is orthogonal)."""
    cols, rows = y_t.shape
    h = rht_matrix(random_sign).to(y_t.device)
    chunks = y_t.to(torch.float32).reshape(cols, rows // BLOCK_SIZE, BLOCK_SIZE)
    return torch.matmul(chunks, h.t()).reshape(cols, rows).t()
