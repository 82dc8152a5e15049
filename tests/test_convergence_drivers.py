"""The convergence-table drivers on CPU: the recipe variants (tests_multigpu/convergence_variants.py) and the flags
that make them in megatron_train.py and nvfp4-train, every variant of tests_multigpu/gpt_convergence.py training a
tiny GPT for a few steps, and tests_multigpu/megatron_convergence.py's commands, collection, gaps and failure
handling with a fake runner in place of torchrun."""
import argparse
import json
import shlex
import warnings

import pytest

from nvfp4_dist import NVFP4Recipe
from nvfp4_dist.launch import cli, plan
from tests.helpers.gpt_model import GPTConfig
from tests_multigpu import convergence_variants as cv
from tests_multigpu import gpt_convergence, megatron_convergence

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
RECIPE_VARIABLES = ("NVFP4_DISABLE_RHT", "NVFP4_ROW_SCALED_ACTIVATION", "NVFP4_4OVER6", "NVFP4_BACKWARD_MODE",
                    "NVFP4_4OVER6_ERR_MODE", "NVFP4_4OVER6_E4M3_USE_256", "NVFP4_4OVER6_ERR_USE_FAST_MATH")


def megatron_train_module():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    from tests_multigpu import megatron_train
    return megatron_train


@pytest.fixture
def clean_environment(monkeypatch):
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES, *RECIPE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_selecting_variants_adds_their_baselines_in_order():
    assert [v.name for v in cv.select(["4over6_all"])] == ["bf16", "nvfp4", "nvfp4_no_rht", "4over6_all"]
    assert [v.name for v in cv.select(["row_scaled", "bf16"])] == ["bf16", "nvfp4", "row_scaled_bf16_backward",
                                                                  "row_scaled"]
    assert [v.name for v in cv.select(cv.NAMES)] == list(cv.NAMES)
    with pytest.raises(ValueError, match=r"variants \['fp8'\]: unknown; the variants are bf16, nvfp4"):
        cv.select(["nvfp4", "fp8"])
    for variant in cv.VARIANTS:  # every baseline is a variant listed before it
        assert variant.baseline is None or cv.NAMES.index(variant.baseline) < cv.NAMES.index(variant.name)


@pytest.mark.parametrize("variant", [v for v in cv.VARIANTS if v.fields is not None], ids=lambda v: v.name)
def test_each_variants_flags_make_its_recipe_in_both_trainers(variant, tmp_path, clean_environment):
    clean_environment.setenv("WORLD_SIZE", "1")
    megatron_train = megatron_train_module()
    args = megatron_train.parse_args(["--spec", "nvfp4", *cv.train_flags(variant)])
    assert NVFP4Recipe.from_env(**megatron_train.recipe_overrides(args)) == NVFP4Recipe(**variant.fields)
    clean_environment.delenv("WORLD_SIZE")
    args = cli.build_parser().parse_args(["--device", "cpu", "--out-dir", str(tmp_path), *cv.train_flags(variant)])
    expected = NVFP4Recipe(**variant.fields, check_finite=True)
    assert plan.make_plan(args).recipe == expected


def test_megatron_train_refuses_recipe_flags_it_cannot_honour(capsys, clean_environment):
    clean_environment.setenv("WORLD_SIZE", "1")
    megatron_train = megatron_train_module()
    for flags, message in ((["--nvfp4-4over6", "all"], "nvfp4_4over6='all' cannot be combined with rht=True"),
                           (["--nvfp4-4over6", "activations", "--no-rht", "--row-scaled-activation"],
                            "cannot be combined with row_scaled_activation=True"),
                           (["--spec", "local", "--no-rht"], "--spec local has no NVFP4 layers")):
        with pytest.raises(SystemExit) as exit_info:
            megatron_train.parse_args(flags)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_gaps_are_relative_to_bf16_and_to_the_baseline():
    variants = cv.select(["4over6_activations"])
    results = cv.add_gaps({v.name: cv.entry(v, [9.0] * 5 + [loss] * 10, 1.0)
                           for v, loss in zip(variants, (2.0, 2.1, 2.2, 2.4))})
    assert [results[name]["final_loss"] for name in results] == pytest.approx([2.0, 2.1, 2.2, 2.4])
    assert results["bf16"]["gap_vs_bf16"] is None and results["bf16"]["gap_vs_baseline"] is None
    assert results["4over6_activations"]["baseline"] == "nvfp4_no_rht"
    assert results["4over6_activations"]["gap_vs_bf16"] == pytest.approx(0.2)
    assert results["4over6_activations"]["gap_vs_baseline"] == pytest.approx(0.2 / 2.2)
    assert results["nvfp4"]["gap_vs_baseline"] == results["nvfp4"]["gap_vs_bf16"] == pytest.approx(0.05)
    assert cv.gpu_suffix("NVIDIA H100 80GB HBM3") == "h100" and cv.gpu_suffix("NVIDIA H200", 2) == "h200x2"


def test_every_gpt_variant_trains_a_tiny_gpt_on_cpu():
    """Same initial weights and stream for all: equal first losses where the forward is the same (BF16 backward
    changes only the gradients), other ones where the forward quantizes differently."""
    tiny = GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_length=32, vocab_size=32)
    results = gpt_convergence.run_variants(cv.VARIANTS, tiny, steps=3, batch_size=2, lr=1e-2, device="cpu")
    assert list(results) == list(cv.NAMES)
    for name, record in results.items():
        assert len(record["losses"]) == 3 and all(loss == loss for loss in record["losses"]), name
        assert record["recipe"] == cv.BY_NAME[name].fields and record["seconds"] > 0
    first = {name: record["first_loss"] for name, record in results.items()}
    assert first["row_scaled"] == first["row_scaled_bf16_backward"]
    assert results["row_scaled"]["losses"][1:] != results["row_scaled_bf16_backward"]["losses"][1:]
    assert len({first[name] for name in ("bf16", "nvfp4", "4over6_weights", "4over6_activations", "4over6_all",
                                         "row_scaled")}) == 6
    assert first["nvfp4_no_rht"] == first["nvfp4"]  # the RHT is on the wgrad operands only


class FakeTorchrun:
    """Stands in for torchrun megatron_train.py: checks the command, writes a result JSON (or fails)."""

    def __init__(self, fail=()):
        self.commands, self.fail = [], fail

    def __call__(self, command, timeout):
        self.commands.append(command)
        parser = argparse.ArgumentParser()
        for flag in ("--tp", "--steps", "--seq", "--micro-batch", "--seed", "--spec", "--out", "--nvfp4-4over6",
                     "--backward-mode"):
            parser.add_argument(flag)
        parser.add_argument("--no-rht", action="store_true")
        parser.add_argument("--row-scaled-activation", action="store_true")
        args = parser.parse_args(command[command.index(str(megatron_convergence.SCRIPT)) + 1:])
        name = [v.name for v in cv.VARIANTS if command[-1].endswith(f"/{v.name}.json")][0]
        if name in self.fail:
            return 1, "Traceback: out of memory"
        loss = 3.0 + 0.01 * cv.NAMES.index(name)
        record = {"losses": [6.0] * 20 + [loss] * 10, "tokens_per_s": 4096.0, "eval_loss": loss,
                  "peak_memory_gib": 1.5, "device": "NVIDIA H100 80GB HBM3", "data": "markov",
                  "data_entropy_rate": 1.2, "megatron_core": "0.16.1",
                  "args": {"layers": 8, "hidden": 1024, "heads": 16, "ffn": 2816, "vocab": 32000, **vars(args)}}
        with open(args.out, "w") as handle:
            json.dump(record, handle)
        return 0, "ok"


def test_megatron_driver_runs_each_variant_once_and_writes_one_json(tmp_path, monkeypatch):
    fake = FakeTorchrun()
    monkeypatch.setattr(megatron_convergence, "run_subprocess", fake)
    out = tmp_path / "result.json"
    assert megatron_convergence.main(["--out", str(out)]) == 0
    words = [shlex.join(command) for command in fake.commands]
    assert len(words) == len(cv.VARIANTS)
    assert "--nproc-per-node=1" in words[0] and "--tp 1 --steps 200 --seq 1024 --micro-batch 4" in words[0]
    assert "--spec local" in words[0] and all("--spec nvfp4" in word for word in words[1:])
    assert "--nvfp4-4over6 all --no-rht" in words[cv.NAMES.index("4over6_all")]
    assert "--row-scaled-activation --backward-mode dequantized" in words[cv.NAMES.index("row_scaled_bf16_backward")]
    record = json.loads(out.read_text())
    assert (record["benchmark"], record["gpus"], record["tp"], record["layers"], record["hidden"]) == \
        ("megatron_convergence", 1, 1, 8, 1024)
    assert list(record["variants"]) == list(cv.NAMES)
    row_scaled = record["variants"]["row_scaled"]
    assert row_scaled["final_loss"] == pytest.approx(3.07) and row_scaled["baseline"] == "row_scaled_bf16_backward"
    assert row_scaled["gap_vs_baseline"] == pytest.approx(0.01 / 3.06)
    assert row_scaled["train_seconds"] == pytest.approx(4 * 1024 * 200 / 4096.0)


def test_megatron_driver_reports_a_failed_run_and_writes_no_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(megatron_convergence, "run_subprocess", FakeTorchrun(fail=("4over6_weights",)))
    out = tmp_path / "result.json"
    assert megatron_convergence.main(["--variants", "4over6_weights", "--nproc", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "4over6_weights: exit status 1" in err and "out of memory" in err and "1 of 3 runs failed" in err
    assert not out.exists()


def test_megatron_driver_refuses_bad_sizes(capsys):
    for flags, message in ((["--nproc", "0"], "--nproc=0: must be >= 1"),
                           (["--nproc", "2", "--tp", "3"], "--tp=3 must divide --nproc=2")):
        with pytest.raises(SystemExit):
            megatron_convergence.parse_args(flags)
        assert message in capsys.readouterr().err
