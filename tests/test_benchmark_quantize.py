"""The quantize benchmark's arithmetic on made-up timings (the timings themselves need a GPU)."""
import pytest

from tests.helpers.benchmarks import load_benchmark_module


@pytest.fixture(scope="module")
def bench():
    return load_benchmark_module("quantize")


def test_stochastic_rounding_ratios_pair_each_sr_kernel_with_its_twin_per_shape(bench):
    results = [
        dict(kernel="1D cast rowwise+columnwise", rows=8, cols=8, ms=2.0),
        dict(kernel="1D SR cast rowwise+columnwise", rows=8, cols=8, ms=2.5),
        dict(kernel="1D cast rowwise+columnwise", rows=16, cols=8, ms=4.0),
        dict(kernel="1D SR cast rowwise+columnwise", rows=16, cols=8, ms=4.2),
        dict(kernel="RHT SR cast", rows=8, cols=8, ms=3.0),  # no RHT twin measured: no ratio
    ]
    ratios = bench.stochastic_rounding_ratios(results)
    assert [(r["rows"], r["cols"], r["time_ratio"]) for r in ratios] == [(8, 8, 1.25), (16, 8, pytest.approx(1.05))]
    assert {r["baseline"] for r in ratios} == {"1D cast rowwise+columnwise"}


def test_fixed_and_per_element_cost_recovers_a_line(bench):
    # 5 us per launch + 2 us per million elements, at 3 element counts
    results = [dict(kernel="k", rows=rows, cols=1000, ms=(5.0 + 2.0 * rows * 1000 / 1e6) / 1e3)
               for rows in (1000, 4000, 9000)]
    (fit,) = bench.fixed_and_per_element_cost(results)
    assert fit["fixed_us"] == pytest.approx(5.0)
    assert fit["us_per_million_elements"] == pytest.approx(2.0)
    assert bench.fixed_and_per_element_cost(results[:2]) == []  # two points fit any line: none reported


def test_card_sampler_summarises_nvidia_smi_lines(bench):
    sampler = bench.CardSampler()
    sampler.lines = ["1980, 84.58, 0x0000000000000000", "1290, 687.85, 0x0000000000000004", "[N/A], [N/A], [N/A]",
                     "1575, 711.86, 0x0000000000000004"]
    assert sampler.summary() == dict(samples=3, sm_clock_mhz_min=1290.0, sm_clock_mhz_max=1980.0, power_w_max=711.86,
                                     throttle_reasons_seen="0x4")
    sampler.lines = []
    assert sampler.summary() is None


def test_results_are_named_by_gpu_kind(monkeypatch):
    """The benchmarks' default JSON path (provenance.default_results_path) carries torchrun_setup.gpu_label's kind."""
    import torch
    from tests.helpers.benchmarks import BENCHMARKS
    provenance = load_benchmark_module("provenance")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when a benchmark runs
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    assert provenance.default_results_path("quantize") == BENCHMARKS / "results" / "quantize_h100.json"
