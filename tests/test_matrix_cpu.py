"""The multi-GPU test matrix (tests_multigpu/matrix.py) on CPU with gloo: the driver launches world sizes 1
and 2 under torchrun with the quick cell subset and writes one report; larger worlds are listed as not run.
"""
import collections
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from tests_multigpu import matrix
from tests_multigpu import matrix_cells as M

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (tp, sp, overlap) configurations per world size, written out independently of the runner.
CONFIGS = {1: [(1, False, False)],
           2: [(1, False, False), (2, False, False), (2, True, False), (2, True, True)],
           4: [(1, False, False)] + [(tp, sp, ov) for tp in (2, 4) for sp, ov in ((False, False), (True, False),
                                                                                  (True, True))],
           8: [(1, False, False)] + [(tp, sp, ov) for tp in (2, 4, 8) for sp, ov in ((False, False), (True, False),
                                                                                     (True, True))]}
QUICK_RECIPES = {"default", "row_scaled"}
LAYER_KINDS = {"column", "row", "mlp", "megatron"}


def run_driver(out: pathlib.Path, *extra: str):
    command = [sys.executable, "-m", "tests_multigpu.matrix", "--driver", "--device", "cpu", "--quick", "--launcher", "torchrun",
               "--out", str(out), *extra]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report_path = out / "matrix_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return result, report


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return run_driver(tmp_path_factory.mktemp("matrix"), "--max-world", "2", "--profile", "b200")


def test_quick_matrix_report(quick_run):
    result, report = quick_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert report is not None
    cells = report["cells"]
    expected = collections.Counter()
    for world, configs in CONFIGS.items():
        for tp, sp, overlap in configs:
            for kind in LAYER_KINDS:
                for recipe in QUICK_RECIPES:
                    expected[(world, tp, world // tp, sp, overlap, recipe, kind)] += 1
        for recipe in QUICK_RECIPES:  # the b200 profile's GEMM cells
            expected[(world, 1, world, False, False, recipe, "gemm_cublaslt")] += 1
    found = collections.Counter((c["world"], c["tp"], c["dp"], c["sp"], c["overlap"], c["recipe"], c["kind"])
                                for c in cells)
    assert found == expected
    counts = collections.Counter(c["status"] for c in cells)
    assert report["summary"] == {"passed": counts["passed"], "failed": 0, "not run": counts["not run"]}
    for key in ("device", "torch", "git_commit", "date"):
        assert report[key], key
    assert set(report["launches"]) == {"1", "2"} and all(l["rc"] == 0 for l in report["launches"].values())
    megatron_reason = M.megatron_missing()
    for cell in cells:
        name, status, reason = cell["name"], cell["status"], cell["reason"]
        if cell["world"] > 2:
            assert status == "not run" and "above --max-world 2" in reason and cell["missing"] == "max-world", name
        elif cell["kind"] == "gemm_cublaslt":
            assert status == "not run" and reason == "needs sm_100 (device is cpu)" and cell["missing"] == "sm_100", name
        elif cell["kind"] == "megatron" and megatron_reason:
            assert status == "not run" and reason.startswith("megatron-core missing"), name
            assert cell["missing"] == "megatron-core", name
        else:  # every built-in layer runs, overlap included
            assert status == "passed", (name, reason)
            assert cell["max_abs_err"] or cell["kind"] == "megatron", name
            if cell["tp"] > 1:
                assert cell["tp1_rel_err"], name
            if cell["overlap"]:
                assert cell["ring_schedules"] > 0, name
    sharded = [c for c in cells if c["world"] == 2 and c["tp"] == 2 and c["sp"] and not c["overlap"]
               and c["kind"] != "megatron"]
    assert len(sharded) == 6 and all(c["status"] == "passed" for c in sharded)
    table = (pathlib.Path(report["launches"]["1"]["log"]).parent / "matrix_table.txt").read_text()
    assert all(c["name"] in table for c in cells)


def test_failing_cell_makes_the_driver_fail(tmp_path):
    """Shapes the format cannot take (hidden 40) fail the cell; the driver reports it and exits 1."""
    result, report = run_driver(tmp_path, "--max-world", "1", "--hidden", "40",
                                "--only", "^w1-tp1-dp1-nosp-plain-default-column$")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["summary"] == {"passed": 0, "failed": 1, "not run": 0}
    (cell,) = report["cells"]
    assert cell["status"] == "failed" and "hidden=40" in cell["reason"]
    assert "failed: 1" in result.stdout


def test_checks_catch_one_bf16_step():
    want = torch.randn(64, 32).bfloat16()
    off_by_one = want.clone()
    off_by_one.view(torch.int16)[3, 5] += 1  # one BF16 step larger in magnitude
    checks = M.Checks()
    checks.against("exact equal", want.clone(), want)
    assert not checks.failures
    checks.against("one step", off_by_one, want)
    assert len(checks.failures) == 1 and "one step" in checks.failures[0]
    checks = M.Checks()
    checks.against("within bound", off_by_one, want, M.BF16_ULP * want.float().abs())
    assert not checks.failures
    checks.against("nan", torch.full_like(want, float("nan")), want, torch.ones(want.shape))
    assert "non-finite" in checks.failures[0]
    checks = M.Checks()
    tolerance = M.TP1_RELATIVE_TOLERANCE
    checks.relative("loose", want.float() * (1 + 1.1 * tolerance), want.float())
    checks.relative("loose ok", want.float() * (1 + 0.9 * tolerance), want.float())
    assert len(checks.failures) == 1 and checks.failures[0].startswith("loose vs TP=1")


def test_reduction_bound_covers_any_summation_order():
    generator = torch.Generator().manual_seed(0)
    partials = [(torch.randn(256, generator=generator) * 10 ** (k - 2)).bfloat16() for k in range(4)]
    zeros = torch.zeros(256)
    total, allowed = M.reduced([(p, zeros) for p in partials])
    assert torch.equal(M.reduced([(partials[0], zeros)])[1], zeros)  # one partial: exact
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        running = partials[order[0]]
        for index in order[1:]:
            running = running + partials[index]  # BF16 add: one rounding per hop
        assert bool(((running.float() - total.float()).abs() <= allowed).all()), order


def test_merge_ranks():
    passed = dict(status="passed", reason="", seconds=1.0, max_abs_err={"y": 0.0}, tp1_rel_err={"y": 0.1})
    failed = dict(status="failed", reason="dx: bad", seconds=2.0, max_abs_err={"y": 0.5}, tp1_rel_err={"y": 0.2})
    merged = matrix.merge_ranks([passed, failed])
    assert merged["status"] == "failed" and merged["reason"] == "rank 1: dx: bad"
    assert merged["seconds"] == 2.0 and merged["max_abs_err"] == {"y": 0.5} and merged["tp1_rel_err_worst"] == 0.2
    not_run = dict(M.not_run("needs sm_100 (device is cpu)", "sm_100"), seconds=0.0)
    merged = matrix.merge_ranks([not_run, not_run])
    assert merged["status"] == "not run" and merged["missing"] == "sm_100"


def test_not_run_without_a_missing_resource_fails_the_driver():
    cells = [dict(name="a", status="not run", reason="needs 8 GPUs (4 present)", missing="gpus"),
             dict(name="b", status="not run", reason="overlap unavailable: refused"),
             dict(name="c", status="not run", reason="skipped", missing="patience"),
             dict(name="d", status="passed", reason="")]
    assert [c["name"] for c in matrix.unexplained_not_run(cells)] == ["b", "c"]
    with pytest.raises(ValueError, match="missing='patience'"):
        M.not_run("skipped", "patience")


def test_overlap_refused_by_a_layer_fails_the_cell(monkeypatch):
    """A ValueError from a built-in layer asked for overlap is a failure, never "not run"."""
    from nvfp4_dist.parallel import overlap

    def refuse(comm, min_chunk_gflops=0):
        raise ValueError("overlap applies to ColumnParallelComm only")
    monkeypatch.setattr(overlap, "overlapped_comm", refuse)
    monkeypatch.setattr(M, "run_layers", lambda *args: overlap.overlapped_comm(None))
    cell = M.Cell(2, 2, True, True, "default", "row")
    shapes = M.Shapes(seq=32, batch=2, hidden=64, ffn=128, heads=4)
    ctx = M.Context(world=2, rank=0, device=torch.device("cpu"), shapes=shapes, groups={2: None, 1: None})
    result = M.run_cell(cell, ctx, None, None)
    assert result["status"] == "failed" and "overlap applies" in result["reason"], result
