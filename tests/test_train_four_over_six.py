"""nvfp4-train's 4over6 flags (docs/numerics.md §12) and the row-scaled recipe's backward switch: what they parse to,
the recipe they make (with the environment for the unset ones), the one-line errors of refused combinations before any
process starts, and 3-step CPU runs in which the flags reach the quantization."""
import pytest

from nvfp4_dist import environment
from nvfp4_dist.launch import cli, plan, spawn, train
from tests.test_train_job import metrics, run_train

FOUR_OVER_SIX_VARIABLES = ("NVFP4_4OVER6", "NVFP4_4OVER6_E4M3_USE_256", "NVFP4_4OVER6_ERR_MODE",
                           "NVFP4_4OVER6_ERR_USE_FAST_MATH", "NVFP4_BACKWARD_MODE")


@pytest.fixture
def clean_environment(monkeypatch):
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES, *FOUR_OVER_SIX_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def recipe_of(tmp_path, *flags):
    args = cli.build_parser().parse_args(["--device", "cpu", "--out-dir", str(tmp_path / "out"), *flags])
    return plan.make_plan(args).recipe


def test_the_flags_choices_are_the_recipes():
    assert cli.FOUR_OVER_SIX_SCOPES == environment.FOUR_OVER_SIX_SCOPES
    assert cli.FOUR_OVER_SIX_ERR_MODES == environment.FOUR_OVER_SIX_ERR_MODES


@pytest.mark.parametrize("flags, fields", [
    ([], dict(nvfp4_4over6="none", nvfp4_4over6_e4m3_use_256="all", nvfp4_4over6_err_mode="MAE",
              nvfp4_4over6_err_use_fast_math=False, rht=True)),
    (["--nvfp4-4over6", "weights"], dict(nvfp4_4over6="weights", rht=True)),
    (["--nvfp4-4over6", "activations", "--no-rht"], dict(nvfp4_4over6="activations", rht=False)),
    (["--nvfp4-4over6", "all", "--no-rht", "--nvfp4-4over6-e4m3-use-256", "weights", "--nvfp4-4over6-err-mode",
      "MSE", "--nvfp4-4over6-err-use-fast-math"],
     dict(nvfp4_4over6="all", rht=False, nvfp4_4over6_e4m3_use_256="weights", nvfp4_4over6_err_mode="MSE",
          nvfp4_4over6_err_use_fast_math=True)),
    (["--nvfp4-4over6-e4m3-use-256", "none"], dict(nvfp4_4over6="none", nvfp4_4over6_e4m3_use_256="none")),
    (["--row-scaled-activation"], dict(row_scaled_activation=True, backward_mode="default")),
    (["--row-scaled-activation", "--backward-mode", "dequantized"],
     dict(row_scaled_activation=True, backward_mode="dequantized")),
    (["--row-scaled-activation", "--nvfp4-4over6", "weights"], dict(row_scaled_activation=True,
                                                                    nvfp4_4over6="weights")),
])
def test_flags_make_the_recipe(tmp_path, clean_environment, flags, fields):
    recipe = recipe_of(tmp_path, *flags)
    assert {name: getattr(recipe, name) for name in fields} == fields


def test_unset_flags_leave_the_environment_and_given_ones_override_it(tmp_path, clean_environment):
    clean_environment.setenv("NVFP4_4OVER6", "weights")
    clean_environment.setenv("NVFP4_4OVER6_ERR_MODE", "mse")
    clean_environment.setenv("NVFP4_4OVER6_ERR_USE_FAST_MATH", "1")
    recipe = recipe_of(tmp_path)
    assert (recipe.nvfp4_4over6, recipe.nvfp4_4over6_err_mode, recipe.nvfp4_4over6_err_use_fast_math) == \
        ("weights", "MSE", True)
    recipe = recipe_of(tmp_path, "--nvfp4-4over6", "none", "--nvfp4-4over6-err-mode", "MAE")
    assert (recipe.nvfp4_4over6, recipe.nvfp4_4over6_err_mode) == ("none", "MAE")


@pytest.mark.parametrize("flags, environment_settings, message", [
    (["--nvfp4-4over6", "all"], {}, "--nvfp4-4over6=all needs --no-rht: 4over6 is not combined with the RHT"),
    (["--nvfp4-4over6", "activations"], {}, "--nvfp4-4over6=activations needs --no-rht"),
    (["--nvfp4-4over6", "activations", "--no-rht", "--row-scaled-activation"], {},
     "--nvfp4-4over6=activations cannot be combined with --row-scaled-activation"),
    ([], {"NVFP4_4OVER6": "all"}, "nvfp4_4over6='all' cannot be combined with rht=True"),
    (["--no-rht", "--row-scaled-activation"], {"NVFP4_4OVER6": "activations"},
     "nvfp4_4over6='activations' cannot be combined with row_scaled_activation=True"),
    ([], {"NVFP4_4OVER6": "some"}, "environment variable NVFP4_4OVER6='some': allowed values are none, weights"),
    (["--nvfp4-4over6", "both"], {}, "argument --nvfp4-4over6: invalid choice: 'both'"),
    (["--nvfp4-4over6-err-mode", "mae"], {}, "argument --nvfp4-4over6-err-mode: invalid choice: 'mae'"),
    (["--nvfp4-4over6-e4m3-use-256", "448"], {}, "argument --nvfp4-4over6-e4m3-use-256: invalid choice: '448'"),
])
def test_refused_combinations_are_one_line_before_any_process_starts(tmp_path, capsys, clean_environment, flags,
                                                                     environment_settings, message):
    for variable, value in environment_settings.items():
        clean_environment.setenv(variable, value)
    clean_environment.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--device", "cpu", "--out-dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("nvfp4-train: error: "), err


def test_three_steps_with_4over6_train_and_differ_from_the_run_without(tmp_path):
    """The CPU path quantizes with the reference: 4over6 on everything gives other losses than the same run
    without it (same seed and data), and both fall."""
    common = ["--steps", "3", "--save-every", "0", "--no-rht"]
    runs = {}
    for name, flags in (("plain", []), ("4over6", ["--nvfp4-4over6", "all", "--nvfp4-4over6-err-mode", "MSE"])):
        result = run_train(tmp_path / name, *common, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [record["loss"] for record in metrics(tmp_path / name)]
        assert len(runs[name]) == 3 and runs[name][-1] < runs[name][0], runs[name]
    assert "nvfp4_4over6='all'" in result.stdout and "nvfp4_4over6_err_mode='MSE'" in result.stdout
    assert runs["4over6"] != runs["plain"]
