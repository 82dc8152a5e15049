"""SequenceParallelNorm: LayerNorm/RMSNorm numerics, SP marking, and its output dtype under autocast."""
import pytest
import torch
import torch.nn.functional as F

from nvfp4_dist.parallel.norm import SequenceParallelNorm


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_matches_torch_and_marks_parameters(normalization):
    norm = SequenceParallelNorm(32, normalization=normalization, sequence_parallel=True)
    x = torch.randn(4, 2, 32)
    expected = F.layer_norm(x, (32,), eps=1e-5) if normalization == "LayerNorm" else F.rms_norm(x, (32,), eps=1e-5)
    torch.testing.assert_close(norm(x), expected)
    assert all(p.sequence_parallel for p in norm.parameters())


def test_output_takes_the_autocast_dtype():
    # Megatron's SP output layer reduce-scatters its input gradient into a buffer of its input's dtype:
    # the norm in front of it must hand over the dtype its matmul's gradient will have.
    norm = SequenceParallelNorm(32)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
        assert out.dtype == torch.bfloat16
        assert (out @ torch.randn(32, 8)).dtype == out.dtype
    assert norm(x).dtype == torch.float32


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="normalization"):
        SequenceParallelNorm(32, normalization="BatchNorm")
    with pytest.raises(ValueError, match="hidden_size"):
        SequenceParallelNorm(0)
