"""The public ops: dispatch, NVFP4Tensor behaviour, and every validation error."""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import NVFP4Recipe, ops
from nvfp4_dist.reference import quantize_tensor


def test_quantize_roles_apply_the_recipe():
    x = torch.randn(32, 64).to(torch.bfloat16)
    assert nv.quantize(x, "weight").block_2d and not nv.quantize(x, "weight").rht
    assert nv.quantize(x, "activation").rht and not nv.quantize(x, "activation").block_2d
    off = NVFP4Recipe(rht=False, weight_2d=False)
    assert not nv.quantize(x, "weight", recipe=off).block_2d and not nv.quantize(x, "gradient", recipe=off).rht


def test_gradient_role_uses_sr_seeded_from_torch():
    x = torch.randn(32, 64).to(torch.bfloat16)
    torch.manual_seed(11)
    a = nv.quantize(x, "gradient")
    torch.manual_seed(11)
    b = nv.quantize(x, "gradient")
    assert torch.equal(a.rowwise_data, b.rowwise_data) and torch.equal(a.columnwise_data, b.columnwise_data)
    rn = nv.quantize(x, "gradient", recipe=NVFP4Recipe(stochastic_rounding=False))
    assert torch.equal(rn.rowwise_data, quantize_tensor(x, rht=True).rowwise_data)
    assert not torch.equal(a.rowwise_data, rn.rowwise_data)


def test_precomputed_amax_is_used():
    x = torch.randn(32, 64)
    q = nv.quantize(x, amax_rowwise=torch.tensor([100.0]), amax_columnwise=torch.tensor([50.0]),
                    recipe=NVFP4Recipe(rht=False))
    assert q.amax_rowwise.item() == 100.0 and q.amax_columnwise.item() == 50.0
    row, col = nv.compute_amaxes(x, recipe=NVFP4Recipe(rht=False))
    assert row.item() == col.item() == x.abs().max().item()


def test_tensor_bytes_save_restore_and_leading_dims():
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    q = nv.quantize(x, recipe=NVFP4Recipe(rht=False))
    assert q.rows == 32 and q.cols == 64
    assert q.nbytes() == 2 * (32 * 32 + 32 * 4) + 2 * 4
    assert q.nbytes() / (x.numel() * 2) < 0.6
    restored = q.metadata().with_tensors(q.tensors())
    assert torch.equal(nv.dequantize(restored), nv.dequantize(q))
    assert nv.dequantize(q).shape == x.shape and nv.dequantize(q).dtype == torch.bfloat16
    assert q.to("cpu").rowwise_data.data_ptr() == q.rowwise_data.data_ptr()
    assert not q.rowwise_only().has_columnwise and not q.columnwise_only().has_rowwise
    assert nv.dequantize(q, copy="columnwise").shape == x.shape


def test_force_reference_routes_cuda_tensors_to_the_reference(monkeypatch):
    """NVFP4_FORCE_REFERENCE=1 sends CUDA tensors to the reference, through the public ops and the GEMM dispatch.
    CUDA tensors here are fake (shape and device only); both backends' functions are replaced by recorders."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nvfp4_dist import kernels
    from nvfp4_dist.gemm import resolve_backend
    with FakeTensorMode():
        x = torch.empty(32, 64, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(64, 16, device="cuda", dtype=torch.uint8)
    called = []
    for module in (nv.reference, kernels):
        for name in ("quantize_tensor", "compute_amaxes", "swap_first_dims"):
            monkeypatch.setattr(module, name, lambda *args, _where=module, **kwargs: called.append(_where))
    recipe = NVFP4Recipe(check_finite=False)

    def dispatch():
        called.clear()
        nv.quantize(x, recipe=recipe)
        nv.compute_amaxes(x, recipe=recipe)
        nv.swap_first_dims(gathered, 2)
        return called
    monkeypatch.setenv("NVFP4_FORCE_REFERENCE", "1")
    assert dispatch() == [nv.reference] * 3
    assert resolve_backend(None, x.device) == "reference"
    monkeypatch.setenv("NVFP4_FORCE_REFERENCE", "0")
    assert dispatch() == [kernels] * 3
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_backend(None, x.device) == "emulated"
    monkeypatch.delenv("NVFP4_FORCE_REFERENCE")
    assert dispatch() == [kernels] * 3
    assert nv.ops.backend_for(torch.zeros(1)) is nv.reference  # CPU tensors: the reference either way


BAD_QUANTIZE_CALLS = [
    (lambda: nv.quantize(torch.zeros(16, 32, dtype=torch.int32)), "dtype"),
    (lambda: nv.quantize(torch.zeros(32)), "at least 2 dims"),
    (lambda: nv.quantize(torch.zeros(16, 24)), "multiple of 16"),
    (lambda: nv.quantize(torch.zeros(8, 32), recipe=NVFP4Recipe(rht=False)), "columnwise copy"),
    (lambda: nv.quantize(torch.zeros(8, 32), "weight", columnwise=False), "2D"),
    (lambda: nv.quantize(torch.zeros(16, 32, dtype=torch.float16)), "bfloat16"),
    (lambda: nv.quantize(torch.zeros(16, 32), "bias"), "role"),
    (lambda: nv.quantize(torch.zeros(16, 32), rowwise=False, columnwise=False), "at least one copy"),
    (lambda: nv.quantize(torch.zeros(16, 32), columnwise=False, amax_rowwise=torch.tensor([1.0, 2.0])), "amax_rowwise"),
    (lambda: nv.quantize(torch.zeros(16, 32), columnwise=False, amax_rowwise=torch.tensor([1.0], dtype=torch.float64)),
     "float32"),
    (lambda: nv.quantize(torch.zeros(16, 32), columnwise=False, sr_row_offset=-1), "sr_row_offset"),
    (lambda: nv.quantize(torch.zeros(16, 32).bfloat16(), recipe=NVFP4Recipe(
        row_scaled_activation=True, rht=False, stochastic_rounding=False, nvfp4_4over6="activations")),
     "cannot be combined with row_scaled_activation"),
    (lambda: nv.quantize(torch.tensor([[float("nan")] * 16] * 16).bfloat16()), "not finite"),
    (lambda: nv.quantize("x"), "torch.Tensor"),
]


@pytest.mark.parametrize("call,message", BAD_QUANTIZE_CALLS)
def test_quantize_validation_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_non_finite_amax_error_type():
    with pytest.raises(nv.NonFiniteAmaxError, match="amax_rowwise"):
        nv.quantize(torch.tensor([[float("inf")] + [1.0] * 15] * 16).bfloat16(), columnwise=False)


def test_non_finite_amax_accepted_when_opted_out():
    q = nv.quantize(torch.tensor([[float("inf")] + [1.0] * 15] * 16), recipe=NVFP4Recipe(rht=False, check_finite=False))
    assert torch.isinf(q.amax_rowwise).all()


def test_dequantize_and_helpers_validation_errors():
    q = nv.quantize(torch.randn(16, 32), columnwise=False)
    with pytest.raises(ValueError, match="no columnwise copy"):
        nv.dequantize(q, copy="columnwise")
    with pytest.raises(ValueError, match="copy="):
        nv.dequantize(q, copy="diagonal")
    with pytest.raises(ValueError, match="NVFP4Tensor"):
        nv.dequantize(torch.zeros(2))
    with pytest.raises(ValueError, match="world_size"):
        nv.swap_first_dims(torch.zeros(6, 4), 4)
    with pytest.raises(ValueError, match="2 dims"):
        nv.swap_first_dims(torch.zeros(6), 2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nv.swizzle_scales(torch.zeros(4, 4))
    for bad in (torch.zeros(6, 4), torch.zeros(5, 4, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="N even"):
            ops.transpose_codes(bad)


def test_transpose_codes_is_the_transpose_of_the_codes():
    """Element (k, n) of the result is element (n, k) of the input, both packed two codes per byte (low nibble
    first); a 16x16-blocked rowwise copy transposed this way is its columnwise copy."""
    packed = torch.randint(0, 256, (6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = ops.transpose_codes(packed)
    assert out.shape == (10, 3)
    for n in range(6):
        for k in range(10):
            code = (packed[n, k // 2] >> (4 * (k % 2))) & 0xF
            assert (out[k, n // 2] >> (4 * (n % 2))) & 0xF == code
    q = nv.quantize(torch.randn(32, 48), "weight", recipe=nv.NVFP4Recipe())
    assert torch.equal(ops.transpose_codes(q.rowwise_data), q.columnwise_data)


def test_gemm_validation_errors():
    a = nv.quantize(torch.randn(16, 32), columnwise=False)
    b = nv.quantize(torch.randn(16, 64), "weight")
    with pytest.raises(ValueError, match="K mismatch"):
        nv.gemm(a, b)
    b = nv.quantize(torch.randn(16, 32), "weight")
    with pytest.raises(ValueError, match="out_dtype"):
        nv.gemm(a, b, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="bias"):
        nv.gemm(a, b, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="accumulate_into"):
        nv.gemm(a, b, accumulate_into=torch.zeros(16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="backend"):
        nv.gemm(a, b, backend="magic")
    with pytest.raises(ValueError, match="needs CUDA"):
        nv.gemm(a, b, backend="emulated")
    with pytest.raises(ValueError, match="no columnwise copy"):
        nv.gemm(a, b, a_copy="columnwise")
    with pytest.raises(ValueError, match="NVFP4Tensor"):
        nv.gemm(torch.zeros(2), b)


def test_gemm_bias_and_accumulate():
    a = nv.quantize(torch.randn(16, 32), columnwise=False)
    b = nv.quantize(torch.randn(16, 32), "weight")
    y = nv.gemm(a, b, out_dtype=torch.float32)
    bias = torch.randn(16)
    assert torch.equal(nv.gemm(a, b, out_dtype=torch.float32, bias=bias), y + bias)
    acc = torch.ones(16, 16)
    out = nv.gemm(a, b, accumulate_into=acc)
    assert out is acc and torch.equal(acc, 1 + y)
