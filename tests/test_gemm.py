"""NVFP4 GEMM on the CPU: the reference against the oracle's float64 product of the decoded bytes (elementwise, within
what FP32 accumulation and the output rounding may add), gemm() options and validation, and the backend choice per
device (the Blackwell backend's arguments: tests/test_blackwell_arguments.py)."""
import dataclasses
import logging

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.gemm import dispatch, gpu_backends
from nvfp4_dist.gemm import gemm, resolve_backend
from tests.helpers import oracle as O

RECIPE = nv.NVFP4Recipe(rht=False, stochastic_rounding=False)
ROW_SCALED = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)


def random_matrix(rows, cols, scale, seed):
    """Random BF16 data with block magnitudes spread over several octaves (never zeros)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * scale
    octaves = torch.randint(-4, 4, (rows, cols // 16, 1), generator=generator).float()
    return (x * torch.exp2(octaves).repeat_interleave(16, 1).reshape(rows, cols)).to(torch.bfloat16)


def layer(m, n, k, seed=0, recipe=RECIPE):
    row_scaled = recipe.row_scaled_activation
    x = nv.quantize(random_matrix(m, k, 1.0, seed), "activation", recipe=recipe, columnwise=not row_scaled)
    w = nv.quantize(random_matrix(n, k, 0.1, seed + 1), "weight", recipe=recipe)
    dy = None if row_scaled else nv.quantize(random_matrix(m, n, 1.0, seed + 2), "gradient", recipe=recipe)
    return x, w, dy


LAYOUTS = {"fprop": lambda x, w, dy: (x, "rowwise", w, "rowwise"),
           "dgrad": lambda x, w, dy: (dy, "rowwise", w, "columnwise"),
           "wgrad": lambda x, w, dy: (dy, "columnwise", x, "columnwise")}


def operands(a, a_copy, b, b_copy):
    pick = lambda q, copy: (getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}"))
    return pick(a, a_copy) + pick(b, b_copy)


def oracle_product(a, a_copy, b, b_copy) -> O.Product:
    """The oracle's float64 A . B^T of the two copies' bytes."""
    return O.product(O.copy_of(a, a_copy), O.copy_of(b, b_copy))


@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (112, 128, 96), (48, 80, 256)])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_reference_matches_the_oracle(m, n, k, name):
    a, a_copy, b, b_copy = LAYOUTS[name](*layer(m, n, k, seed=m + k))
    out = reference.gemm_reference(*operands(a, a_copy, b, b_copy))
    expected = oracle_product(a, a_copy, b, b_copy)
    assert out.dtype == torch.float32
    O.check_within(name, out, expected.value, expected.bound(torch.float32))


def test_reference_row_scaled_matches_the_oracle():
    x, w, _ = layer(64, 48, 160, seed=4, recipe=ROW_SCALED)
    assert x.amax_rowwise.shape == (64,)
    expected = oracle_product(x, "rowwise", w, "rowwise")
    out = reference.gemm_reference(*operands(x, "rowwise", w, "rowwise"))
    O.check_within("row-scaled fprop", out, expected.value, expected.bound(torch.float32))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_public_gemm_on_cpu(name):
    a, a_copy, b, b_copy = LAYOUTS[name](*layer(96, 64, 80, seed=9))
    expected = oracle_product(a, a_copy, b, b_copy)
    out = gemm(a, b, a_copy=a_copy, b_copy=b_copy)
    assert out.dtype == torch.bfloat16 and out.shape == expected.value.shape
    O.check_within(f"{name} bf16", out, expected.value, expected.bound(torch.bfloat16))
    bias = torch.randn(expected.value.shape[1])
    out32 = gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=torch.float32, bias=bias)
    assert out32.dtype == torch.float32
    O.check_within(f"{name} fp32 + bias", out32, expected.value + bias.double().numpy(),
                   expected.bound(torch.float32, bias))
    main_grad = torch.randn(*expected.value.shape)
    before = main_grad.double().numpy()
    returned = gemm(a, b, a_copy=a_copy, b_copy=b_copy, accumulate_into=main_grad)
    assert returned is main_grad
    total = before + expected.value  # one more FP32 rounding: the add into main_grad
    O.check_within(f"{name} accumulated", main_grad, total,
                   expected.bound(torch.float32) + O.FP32_UNIT_ROUNDOFF * (abs(total) + expected.bound(torch.float32)))
    whole = torch.zeros(3 * out.shape[0], out.shape[1], dtype=torch.bfloat16)
    rows = slice(out.shape[0], 2 * out.shape[0])
    returned = gemm(a, b, a_copy=a_copy, b_copy=b_copy, out=whole[rows])
    assert returned.data_ptr() == whole[rows].data_ptr()
    assert torch.equal(whole[rows], out) and not whole[:out.shape[0]].any() and not whole[rows.stop:].any()


def test_gemm_validation_errors():
    x, w, dy = layer(32, 48, 64)
    with pytest.raises(ValueError, match="K mismatch"):
        gemm(x, dy)
    with pytest.raises(ValueError, match="a_copy"):
        gemm(x, w, a_copy="diagonal")
    with pytest.raises(ValueError, match="holds no columnwise copy"):
        gemm(x.rowwise_only(), w, a_copy="columnwise", b_copy="columnwise")
    with pytest.raises(ValueError, match="must be an NVFP4Tensor"):
        gemm(torch.zeros(32, 64), w)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm(x, w, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="bias"):
        gemm(x, w, bias=torch.ones(47))
    with pytest.raises(ValueError, match="accumulate_into"):
        gemm(x, w, accumulate_into=torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="accumulate_into"):
        gemm(x, w, accumulate_into=torch.zeros(48, 32).t())
    with pytest.raises(ValueError, match="out: expected"):
        gemm(x, w, out=torch.zeros(32, 48, dtype=torch.float32))
    with pytest.raises(ValueError, match="out: expected"):
        gemm(x, w, out=torch.zeros(48, 32, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="at most one"):
        gemm(x, w, out=torch.zeros(32, 48, dtype=torch.bfloat16), accumulate_into=torch.zeros(32, 48))
    with pytest.raises(ValueError, match="backend"):
        gemm(x, w, backend="fastest")
    with pytest.raises(ValueError, match="needs CUDA"):
        gemm(x, w, backend="cublaslt")
    with pytest.raises(ValueError, match="b's amax has 5 values"):
        gemm(x, dataclasses.replace(w, amax_rowwise=torch.ones(5)))


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("NVFP4_GEMM_BACKEND", raising=False)
    assert resolve_backend(None, cpu) == "reference"
    monkeypatch.setenv("NVFP4_GEMM_BACKEND", "emulated")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend(None, cpu)
    monkeypatch.setenv("NVFP4_GEMM_BACKEND", "reference")
    assert resolve_backend(None, cpu) == "reference"
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fastest")
    with pytest.raises(ValueError, match="NVFP4_HOPPER_GEMM"):
        gpu_backends.hopper_path()
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fused")
    assert gpu_backends.hopper_path() == "fused"
    monkeypatch.delenv("NVFP4_HOPPER_GEMM")
    assert gpu_backends.hopper_path() == "dequantize"


@pytest.mark.parametrize("capability,backend,named", [
    ((10, 0), "cublaslt", "B200"), ((10, 3), "cublaslt", "B300"), ((12, 0), "cublaslt", "RTX PRO 6000"),
    ((12, 1), "cublaslt", "not listed"), ((9, 0), "emulated", "no FP4 tensor cores"),
    ((8, 9), "reference", "emulation needs sm_90")], ids=str)
def test_auto_backend_by_capability(capability, backend, named, monkeypatch, caplog):
    """auto picks cuBLASLt on every Blackwell, the emulation on Hopper, the reference below; logged once."""
    monkeypatch.delenv("NVFP4_GEMM_BACKEND", raising=False)
    monkeypatch.delenv("NVFP4_FORCE_REFERENCE", raising=False)
    monkeypatch.setattr(dispatch, "_logged_decisions", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="nvfp4_dist"):
        assert resolve_backend(None, device) == backend
        assert resolve_backend("auto", device) == backend
    records = [r for r in caplog.records if r.name == "nvfp4_dist" and "NVFP4 GEMM on cuda:0" in r.getMessage()]
    assert len(records) == 1
    message = records[0].getMessage()
    assert f"backend {backend!r}" in message and f"sm_{capability[0]}{capability[1]}" in message and named in message
    monkeypatch.setenv("NVFP4_FORCE_REFERENCE", "1")
    with caplog.at_level(logging.INFO, logger="nvfp4_dist"):
        assert resolve_backend(None, device) == "reference"
    assert "NVFP4_FORCE_REFERENCE" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("capability,refused", [((9, 0), "cublaslt"), ((8, 0), "cublaslt"), ((8, 6), "emulated")],
                         ids=str)
def test_explicit_backend_the_gpu_cannot_run(capability, refused, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    sm = f"sm_{capability[0]}{capability[1]}"
    with pytest.raises(ValueError, match=f"backend='{refused}' needs sm_.*; cuda:1 is {sm}"):
        resolve_backend(refused, torch.device("cuda", 1))
    assert resolve_backend("reference", torch.device("cuda", 1)) == "reference"


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0), (9, 0)], ids=str)
def test_explicit_backends_each_gpu_runs(capability, monkeypatch):
    """The emulation also runs on Blackwell (the b200 matrix compares it with cuBLASLt)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = torch.device("cuda", 0)
    assert resolve_backend("emulated", device) == "emulated"
    if capability >= (10, 0):
        assert resolve_backend("cublaslt", device) == "cublaslt"
