"""The Megatron GPT benchmark's profile arithmetic on made-up kernel events (the profile itself needs GPUs)."""
import pytest

from tests.helpers.benchmarks import load_benchmark_module


@pytest.fixture(scope="module")
def bench():
    # the benchmark imports Megatron-Core at its top, to build the models it measures
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    return load_benchmark_module("megatron_gpt")


def kernel(name, start_ms, end_ms, stream):
    return {"name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3, "args": {"stream": stream}}


def test_communication_lane_counts_overlapping_transfers_once_and_names_what_ran_while_idle(bench):
    events = [kernel("ncclDevKernel_AllGather_RING_LL", 0, 10, 43),
              kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 5, 15, 43),  # overlaps the first: counted once
              kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 12, 14, 7),       # on the compute stream, inside
              kernel("nvjet_gemm", 2, 20, 7),
              kernel("silu_kernel", 20, 23, 7),
              kernel("ncclDevKernel_AllGather_RING_LL", 30, 40, 43),
              kernel("nvjet_gemm", 41, 44, 7)]                                   # after the last transfer
    lines = bench.communication_lane_lines(events, top=2)
    assert lines[0] == ("communication lane (NCCL kernels, any stream): busy 25.00 ms of the step's 44.00 ms, "
                        "idle 19.00 ms")
    # the longest stretch first: 15 to 30 ms, the GEMM's last 5 ms and SiLU in it; then the 4 ms after the last
    # transfer (at most `top` stretches)
    assert lines[2].split() == ["15.000", "at", "15.00", "nvjet_gemm", "5.00;", "silu_kernel", "3.00"]
    assert lines[3].split() == ["4.000", "at", "40.00", "nvjet_gemm", "3.00"]
    assert len(lines) == 4


def test_communication_lane_of_a_step_without_transfers_is_all_idle(bench):
    lines = bench.communication_lane_lines([kernel("nvjet_gemm", 1, 3, 7)])
    assert lines[0].endswith("busy 0.00 ms of the step's 2.00 ms, idle 2.00 ms")
    assert lines[2].split() == ["2.000", "at", "0.00", "nvjet_gemm", "2.00"]
