"""recipe.check_finite on CUDA: no host sync per quantize, the NaN/Inf still reported (nvfp4_dist/finite_check.py).

    python3 -m pytest -q tests_multigpu/test_finite_check_gpu.py
"""
import time

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import finite_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def finite(rows=64, cols=64):
    return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)


def test_nan_input_is_reported_then_cleared():
    """Raised by the quantize itself when its check already landed, else by raise_pending_nonfinite()."""
    nv.raise_pending_nonfinite()
    poisoned = finite()
    poisoned[3, 5] = float("nan")
    with pytest.raises(nv.NonFiniteAmaxError, match="amax_(rowwise|columnwise) is not finite"):
        nv.quantize(poisoned, "activation")
        nv.raise_pending_nonfinite()
    nv.quantize(finite(), "activation")
    nv.raise_pending_nonfinite()  # the error was consumed: clean input passes


def test_inf_in_row_scaled_amax_is_reported():
    poisoned = finite()
    poisoned[7, 0] = float("inf")
    recipe = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
    with pytest.raises(nv.NonFiniteAmaxError, match="inf"):
        nv.quantize(poisoned, "activation", columnwise=False, recipe=recipe)
        nv.raise_pending_nonfinite()


def test_a_later_quantize_raises_once_the_check_landed():
    nv.raise_pending_nonfinite()
    poisoned = finite()
    poisoned[0, 0] = float("nan")
    torch.cuda._sleep(200_000_000)  # the GPU is busy: the check cannot have landed when quantize returns
    nv.quantize(poisoned, "weight")
    assert not finite_check._records.any_view[0]
    torch.cuda.synchronize()
    with pytest.raises(nv.NonFiniteAmaxError, match="checked on the GPU without waiting"):
        nv.quantize(finite(), "weight")
    nv.raise_pending_nonfinite()


def test_quantize_does_not_wait_for_the_gpu():
    """With the GPU busy for ~1 s, 20 checked quantizes return at once."""
    x = finite(1024, 1024)
    nv.quantize(x, "activation")
    nv.raise_pending_nonfinite()
    torch.cuda._sleep(2_000_000_000)
    began = time.perf_counter()
    for _ in range(20):
        nv.quantize(x, "activation")
    host_seconds = time.perf_counter() - began
    assert host_seconds < 0.5, host_seconds
    nv.raise_pending_nonfinite()


def test_given_amax_checks_wait_in_order_and_are_bounded():
    """Checks of given amaxes queue copies behind events: at most MAX_PENDING wait, all settled by raise_pending."""
    x = finite(1024, 1024)
    amax = x.abs().amax().float().reshape(1)
    nv.quantize(x, "weight", amax_rowwise=amax, amax_columnwise=amax)  # first launches (module loading) done here
    nv.raise_pending_nonfinite()
    torch.cuda._sleep(1_000_000_000)
    for _ in range(5):
        nv.quantize(x, "weight", amax_rowwise=amax, amax_columnwise=amax)
    assert 0 < len(finite_check._pending) <= finite_check.MAX_PENDING
    nv.raise_pending_nonfinite()
    assert not finite_check._pending


def test_check_finite_false_skips_the_check():
    poisoned = finite()
    poisoned[1, 1] = float("nan")
    nv.quantize(poisoned, "activation", recipe=nv.NVFP4Recipe(check_finite=False))
    nv.raise_pending_nonfinite()


def test_keyed_check_records_without_a_host_copy_and_reports():
    """finite_check.check with a key (the tensor-parallel layers' group checks) folds its values into one reused
    record: no sync, no pinned copy per call; a NaN is reported once, with the values of the call that found it."""
    nv.raise_pending_nonfinite()
    explain = lambda values: None if all(v == v and abs(v) != float("inf") for v in values) else f"bad {values}"  # noqa: E731
    key = ("test keyed check",)
    finite_check.check(torch.ones(3, device="cuda"), explain, key=key)
    pending = len(finite_check._pending)
    clean = torch.ones(3, device="cuda")
    nan = torch.tensor([1.0, float("nan"), 2.0], device="cuda")
    inf = torch.tensor([float("inf"), 1.0, 1.0], device="cuda")
    torch.cuda._sleep(200_000_000)
    with _sync_debug("error"):
        for _ in range(5):
            finite_check.check(clean, explain, key=key)
        finite_check.check(nan, explain, key=key)
        finite_check.check(inf, explain, key=key)
    assert len(finite_check._pending) == pending  # no event-backed host copies
    with pytest.raises(nv.NonFiniteAmaxError, match=r"bad \[1.0, nan, 2.0\]"):
        nv.raise_pending_nonfinite()
    finite_check.check(torch.ones(3, device="cuda"), explain, key=key)
    nv.raise_pending_nonfinite()  # reported once: the record was cleared


class _sync_debug:
    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(self.mode)

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.previous)
