"""The symmetric-memory collectives (parallel/symmetric.py, csrc/peer_gather.cu) against their NCCL twins, byte for byte.

    torchrun --nproc-per-node 2 -m pytest tests_multigpu/test_symmetric_gpu.py -q
    torchrun --nproc-per-node 4 -m pytest tests_multigpu/test_symmetric_gpu.py -q

Every check runs several rounds with fresh data so that both halves of the double-buffered workspace,
and the reuse of a half two calls later, are exercised; one shape is large enough to grow the workspace.
"""

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist.linear import operand_amaxes, quantize_operand
from nvfp4_dist.parallel import all_gather_nvfp4, all_reduce_amax
from nvfp4_dist.parallel import symmetric
from nvfp4_dist.reference import swap_first_dims

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs GPUs"),
              pytest.mark.usefixtures("nccl_group")]
ROUNDS = 5


def test_enabled_on_one_host():
    assert symmetric.enabled(), "2-8 NCCL ranks on one H100/H200 host must take the symmetric-memory path"


def test_amax_max_equals_nccl():
    rank = dist.get_rank()
    generator = torch.Generator(device="cuda").manual_seed(17 + rank)
    for _ in range(ROUNDS):
        a = torch.rand(1, device="cuda", generator=generator) * 100
        b = torch.rand(1, device="cuda", generator=generator)
        expected = [a.clone(), b.clone()]
        for t in expected:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got = all_reduce_amax([a, None, b])
        assert got[1] is None
        assert torch.equal(a, expected[0]) and torch.equal(b, expected[1])
    nan = torch.tensor([float("nan") if rank == 1 else 1.0], device="cuda")
    all_reduce_amax([nan])
    assert torch.isinf(nan).all(), "a NaN amax on one rank must reach every rank, as +inf (check_finite catches it)"


CASES = [  # (role, recipe, dtype, local rows, cols)
    ("activation", nv.NVFP4Recipe(), torch.bfloat16, 32, 48),
    ("gradient", nv.NVFP4Recipe(), torch.bfloat16, 48, 272),
    ("activation", nv.NVFP4Recipe(rht=False), torch.float32, 16, 16),
    ("weight", nv.NVFP4Recipe(), torch.bfloat16, 64, 128),
    ("activation", nv.NVFP4Recipe(), torch.bfloat16, 4096, 8192),  # 20 MB per rank: the workspace grows
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_nvfp4_gather_equals_nccl(case):
    role, recipe, dtype, rows, cols = CASES[case]
    rank = dist.get_rank()
    generator = torch.Generator(device="cuda").manual_seed(100 * case + rank)
    for round_ in range(ROUNDS):
        local = (torch.randn(rows, cols, device="cuda", generator=generator) * (round_ + 1)).to(dtype)
        amaxes = list(operand_amaxes(local, role, recipe, rowwise=True, columnwise=True))
        all_reduce_amax(amaxes)
        q = quantize_operand(local, role, recipe, amax_rowwise=amaxes[0], amax_columnwise=amaxes[1],
                             sr_seed=round_ if role == "gradient" else None, sr_row_offset=rank * rows)
        got = all_gather_nvfp4(q, peer_memory=True)
        expected = all_gather_nvfp4(q, peer_memory=False)
        for name in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale", "amax_rowwise"):
            g, e = getattr(got, name), getattr(expected, name)
            assert (g is None) == (e is None), name
            if g is not None:
                assert g.shape == e.shape and torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (case, round_, name)


def test_row_scaled_gather_equals_nccl():
    recipe = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
    local = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16) * (dist.get_rank() + 1)
    q = nv.quantize(local, "activation", columnwise=False, recipe=recipe)
    got, expected = all_gather_nvfp4(q, peer_memory=True), all_gather_nvfp4(q, peer_memory=False)
    for name in ("rowwise_data", "rowwise_scale", "amax_rowwise"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(expected, name).view(torch.uint8)), name


@pytest.mark.parametrize("shape", [(3, 5), (4, 12), (16, 32), (0, 8)])
def test_raw_gather_any_alignment(shape):
    """Byte, 4-byte and 16-byte vector paths, concatenated and interleaved, and an empty piece."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for round_ in range(ROUNDS):
        piece = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(round_ * 10 + rank))
        flat = torch.empty((world_size * shape[0], shape[1]), dtype=torch.uint8, device="cuda")
        dist.all_gather_into_tensor(flat, piece)
        got = symmetric.all_gather({"rows": piece, "swapped": piece.clone()}, {"swapped"})
        assert torch.equal(got["rows"], flat)
        assert torch.equal(got["swapped"], swap_first_dims(flat.cpu(), world_size).cuda())
