"""benchmarks/moe_convergence.py end to end at tiny sizes (3 steps, EP=2 on gloo): the three models on both data
sources, the JSON's fields, finite losses, the NVFP4 runs' experts and dispatch, the gaps to BF16."""
import json
import math
import pickle

import pytest

from tests.helpers.benchmarks import load_benchmark_module
from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")

TINY = ["--steps", "3", "--hidden", "32", "--ffn", "32", "--moe-ffn", "16", "--heads", "2", "--seq", "16",
        "--micro-batch", "2", "--final-window", "2", "--curve-every", "2", "--warmup", "2"]


def _rank0_to_file(rank, world_size, bench, path, args):
    result = bench.worker(rank, world_size, args)
    if rank == 0:
        with open(path, "wb") as file:
            pickle.dump(result, file)


def test_tiny_run_writes_the_json(tmp_path, monkeypatch):
    bench = load_benchmark_module("moe_convergence")

    def forked_ranks(fn, world_size, args):  # the script's spawned ranks, forked here (no re-import per rank)
        assert fn is bench.worker
        path = tmp_path / "rank0.pickle"
        run_distributed(_rank0_to_file, world_size, bench, str(path), args)
        return pickle.loads(path.read_bytes())
    monkeypatch.setattr(bench, "run_on_gloo_ranks", forked_ranks)
    out = tmp_path / "moe_convergence.json"
    assert bench.main([*TINY, "--out", str(out)]) == 0
    record = json.loads(out.read_text())

    assert record["benchmark"] == "moe_convergence" and record["device"] == "cpu (gloo)"
    assert record["ep"] == record["world_size"] == 2
    for key in ("date", "commit", "torch", "megatron_core", "command", "seconds", "passed"):
        assert key in record, key
    assert record["tolerance"] == bench.TOLERANCE == 0.02
    settings = record["settings"]
    assert (settings["layers"], settings["moe_layers"], settings["experts"], settings["topk"]) == (4, 3, 8, 2)
    assert settings["steps"] == 3 and settings["hidden"] == 32 and settings["vocab"] == 256
    assert sorted(record["sources"]) == ["fables", "markov"]
    assert record["sources"]["fables"]["data_entropy_rate"] is None
    assert 0 < record["sources"]["markov"]["data_entropy_rate"] < math.log(256)
    checks = []
    for source in record["sources"].values():
        models = source["models"]
        assert list(models) == ["bf16", "nvfp4", "nvfp4_dispatch"]
        for name, model in models.items():
            assert model["curve"]["steps"] == [0, 2]
            assert all(math.isfinite(loss) for loss in model["curve"]["loss"])
            assert math.isfinite(model["final_loss"]) and math.isfinite(model["first_loss"])
            assert model["experts"] == ("SequentialMLP" if name == "bf16" else "NVFP4GroupedMLP")
            assert model["experts_ran_nvfp4"] is (name != "bf16")
            assert (model["nvfp4_dispatch_calls_rank0"] > 0) is (name == "nvfp4_dispatch")
            if name == "bf16":
                assert "rel_diff_vs_bf16" not in model
                continue
            gap = (model["final_loss"] - models["bf16"]["final_loss"]) / models["bf16"]["final_loss"]
            assert model["rel_diff_vs_bf16"] == pytest.approx(gap)
            assert model["within_tolerance"] is (abs(gap) <= 0.02)
            checks.append(model["within_tolerance"])
    assert record["passed"] is all(checks)


def test_final_loss_curve_and_lr_schedule():
    bench = load_benchmark_module("moe_convergence")
    assert bench.final_loss([4.0, 3.0, 2.0, 1.0], 2) == 1.5
    assert bench.curve([5.0, 4.0, 3.0, 2.0, 1.0, 0.5], 2) == {"steps": [0, 2, 4, 5], "loss": [5.0, 3.0, 1.0, 0.5]}
    args = bench.parse_args(["--steps", "100", "--warmup", "10"])
    factors = [bench.lr_factor(step, args) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=1e-3) and factors == factors[:10] + sorted(factors[10:], reverse=True)
