"""Which GEMM path the layers' hot path (nvfp4_dist/hot_path.py) takes, decided on the CPU: the path per GPU and
environment (the decision is cached per setting, so a change of NVFP4_* variables takes effect at the next call),
and which operands the cuBLASLt FP4 path takes as they are (the rest go to gemm(), which pads, copies or explains).
The paths' results are compared with gemm()'s on GPUs (tests_multigpu/test_hot_path_gpu.py)."""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import hot_path
from nvfp4_dist.gemm import dispatch


@pytest.fixture
def capability(monkeypatch):
    """Set the compute capability every CUDA device reports."""
    monkeypatch.delenv("NVFP4_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("NVFP4_GEMM_BACKEND", raising=False)
    monkeypatch.delenv("NVFP4_HOPPER_GEMM", raising=False)
    hot_path._gpu_gemm_path.cache_clear()
    chosen = {}
    monkeypatch.setattr(dispatch, "device_capability", lambda device: chosen["value"])
    yield lambda value: chosen.__setitem__("value", value)
    hot_path._gpu_gemm_path.cache_clear()


def path(gemm_backend="auto"):
    return hot_path._gpu_gemm_path(hot_path._switches(), 0, gemm_backend)


def test_the_path_follows_the_gpu_and_the_environment(capability, monkeypatch):
    capability((10, 0))
    assert path() == "scaled_mm"
    assert path("emulated") == "dequantize"  # a recipe may ask for the emulation, which runs on Blackwell too
    capability((9, 0))
    hot_path._gpu_gemm_path.cache_clear()
    assert path() == "dequantize"
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fused")
    assert path() == ""
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "dequantize")
    assert path() == "dequantize"
    monkeypatch.setenv("NVFP4_FORCE_REFERENCE", "1")
    assert path() == ""
    monkeypatch.delenv("NVFP4_FORCE_REFERENCE")
    monkeypatch.setenv("NVFP4_GEMM_BACKEND", "reference")
    assert path() == ""
    with pytest.raises(ValueError, match="needs sm_100"):
        path("cublaslt")


def operands(m=64, n=48, k=128, recipe=None):
    """A layer's fprop operands, quantized on the CPU (metadata and layout as on a GPU)."""
    recipe = recipe or nv.NVFP4Recipe(stochastic_rounding=False)
    x = nv.quantize(torch.randn(m, k).to(torch.bfloat16), "activation", recipe=recipe)
    w = nv.quantize(torch.randn(n, k).to(torch.bfloat16), "weight", recipe=recipe)
    return x, w


def takes(a, b, a_copy="rowwise", b_copy="rowwise", bias=None, out_dtype=torch.bfloat16, accumulate_into=None,
          out=None):
    return hot_path._scaled_mm_takes(getattr(a, f"{a_copy}_data"), getattr(a, f"{a_copy}_scale"),
                                     getattr(a, f"amax_{a_copy}"), getattr(b, f"{b_copy}_data"),
                                     getattr(b, f"{b_copy}_scale"), getattr(b, f"amax_{b_copy}"), bias, out_dtype,
                                     accumulate_into, out)


def test_the_scaled_mm_path_takes_the_layers_operands():
    x, w = operands()
    assert takes(x, w)
    assert takes(x, w, bias=torch.zeros(48, dtype=torch.float32), out_dtype=torch.float32)
    assert takes(x, x, "columnwise", "columnwise", accumulate_into=torch.zeros(128, 128))
    assert takes(x, w, out=torch.zeros(64, 96, dtype=torch.bfloat16)[:, :48])  # unit column stride is enough
    row_scaled = nv.NVFP4Recipe(row_scaled_activation=True, stochastic_rounding=False)
    xr, _ = operands(recipe=row_scaled)
    assert takes(xr, w) and takes(x, xr, "columnwise", "columnwise")


def test_operands_cublaslt_needs_padded_or_copied_go_to_gemm():
    assert not takes(*operands(k=80))          # K % 32 == 16: both get a block of zero codes
    x, _ = operands()
    b = nv.quantize(torch.randn(40, 128).to(torch.bfloat16), "activation", columnwise=False,
                    recipe=nv.NVFP4Recipe(stochastic_rounding=False))
    assert not takes(x, b)                     # N % 16 != 0: B gets zero rows
    x, w = operands()
    shifted = torch.zeros(64 * 64 + 8, dtype=torch.uint8)[8:].view(64, 64)  # 8 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 and not hot_path._scaled_mm_takes(
        shifted, x.rowwise_scale, x.amax_rowwise, w.rowwise_data, w.rowwise_scale, w.amax_rowwise, None,
        torch.bfloat16, None, None)
    assert not takes(*operands(m=0))  # nothing to multiply


def test_what_the_epilogue_kernel_cannot_do_goes_to_gemm():
    x, w = operands()
    assert not takes(x, w, bias=torch.zeros(48, dtype=torch.float64))   # the kernel reads 16- and 32-bit biases
    assert not takes(x, w, bias=torch.zeros(47))
    assert not takes(x, w, bias=torch.zeros(1, 48))
    assert not takes(x, w, out_dtype=torch.float32, out=torch.zeros(64, 48, dtype=torch.bfloat16))
    assert not takes(x, w, out=torch.zeros(48, 64, dtype=torch.bfloat16).t())  # no unit column stride
    assert not takes(x, w, accumulate_into=torch.zeros(64, 48, dtype=torch.bfloat16))  # gemm() explains: FP32 only
    assert not takes(x, w, accumulate_into=torch.zeros(64, 48), out=torch.zeros(64, 48, dtype=torch.bfloat16))
    assert not takes(x, w, accumulate_into=torch.zeros(48, 64))
    wrong_amax = w.replace(amax_rowwise=torch.ones(3))
    assert not takes(x, wrong_amax)
