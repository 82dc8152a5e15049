"""NVFP4Recipe options, environment overrides and rejected combinations (docs/numerics.md §10)."""
import pytest

from nvfp4_dist import NVFP4Recipe


def test_defaults_follow_the_nvidia_recipe():
    r = NVFP4Recipe()
    assert (r.rht, r.stochastic_rounding, r.weight_2d, r.row_scaled_activation) == (True, True, True, False)
    assert (r.bf16_first_layers, r.bf16_last_layers, r.gemm_backend) == (0, 0, "auto")


@pytest.mark.parametrize("kwargs,message", [
    (dict(row_scaled_activation=True, rht=False, nvfp4_4over6="activations"), "row_scaled_activation"),
    (dict(gemm_backend="cutlass"), "gemm_backend"),
    (dict(bf16_first_layers=-1), "bf16_first_layers"),
    (dict(bf16_last_layers=1.5), "bf16_last_layers"),
    (dict(overlap_min_chunk_gflops=-1), "overlap_min_chunk_gflops"),
])
def test_bad_combinations_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NVFP4Recipe(**kwargs)


def test_row_scaled_keeps_the_rht_and_sr_of_the_nvfp4_backward():
    """Row-scaled layers run backward in NVFP4 (docs/numerics.md §6b), so the recipe's RHT and SR stay on."""
    r = NVFP4Recipe(row_scaled_activation=True)
    assert r.row_scaled_activation and r.rht and r.stochastic_rounding
    assert NVFP4Recipe(row_scaled_activation=True, rht=False, nvfp4_4over6="weights").nvfp4_4over6 == "weights"


@pytest.mark.parametrize("var,field,value", [
    ("NVFP4_DISABLE_RHT", "rht", False), ("NVFP4_DISABLE_SR", "stochastic_rounding", False),
    ("NVFP4_DISABLE_2D", "weight_2d", False), ("NVFP4_ROW_SCALED_ACTIVATION", "row_scaled_activation", True),
])
def test_environment_overrides(monkeypatch, var, field, value):
    monkeypatch.setenv(var, "1")
    assert getattr(NVFP4Recipe.from_env(), field) == value


def test_environment_numbers_and_backend(monkeypatch):
    monkeypatch.setenv("NVFP4_BF16_FIRST_LAYERS", "2")
    monkeypatch.setenv("NVFP4_BF16_LAST_LAYERS", "1")
    monkeypatch.setenv("NVFP4_GEMM_BACKEND", "reference")
    monkeypatch.setenv("NVFP4_OVERLAP_MIN_CHUNK_GFLOPS", "0")
    r = NVFP4Recipe.from_env()
    assert (r.bf16_first_layers, r.bf16_last_layers, r.gemm_backend) == (2, 1, "reference")
    assert (NVFP4Recipe().overlap_min_chunk_gflops, r.overlap_min_chunk_gflops) == (256, 0)
    assert [r.is_bf16_layer(i, 6) for i in range(6)] == [True, True, False, False, False, True]


def test_environment_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("NVFP4_DISABLE_RHT", "yes")
    with pytest.raises(ValueError, match="NVFP4_DISABLE_RHT"):
        NVFP4Recipe.from_env()
    monkeypatch.setenv("NVFP4_DISABLE_RHT", "0")
    monkeypatch.setenv("NVFP4_BF16_FIRST_LAYERS", "two")
    with pytest.raises(ValueError, match="NVFP4_BF16_FIRST_LAYERS"):
        NVFP4Recipe.from_env()


def test_explicit_overrides_win_over_environment(monkeypatch):
    monkeypatch.setenv("NVFP4_DISABLE_SR", "1")
    assert NVFP4Recipe.from_env(stochastic_rounding=True).stochastic_rounding


def test_4over6_fields_follow_transformer_engine():
    r = NVFP4Recipe()
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode,
            r.nvfp4_4over6_err_use_fast_math) == ("none", "all", "MAE", False)


@pytest.mark.parametrize("kwargs,message", [
    (dict(nvfp4_4over6="gradients", rht=False), "nvfp4_4over6"),
    (dict(nvfp4_4over6_e4m3_use_256="some"), "nvfp4_4over6_e4m3_use_256"),
    (dict(nvfp4_4over6_err_mode="mae"), "nvfp4_4over6_err_mode"),
    (dict(nvfp4_4over6_err_use_fast_math="1"), "nvfp4_4over6_err_use_fast_math"),
    (dict(nvfp4_4over6="activations"), "rht"),
    (dict(nvfp4_4over6="all"), "rht"),
])
def test_bad_4over6_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NVFP4Recipe(**kwargs)


def test_4over6_on_weights_keeps_the_rht():
    assert NVFP4Recipe(nvfp4_4over6="weights").rht


def test_4over6_environment(monkeypatch):
    monkeypatch.setenv("NVFP4_4OVER6", "all")
    monkeypatch.setenv("NVFP4_DISABLE_RHT", "1")
    monkeypatch.setenv("NVFP4_4OVER6_E4M3_USE_256", "weights")
    monkeypatch.setenv("NVFP4_4OVER6_ERR_MODE", "mse")
    monkeypatch.setenv("NVFP4_4OVER6_ERR_USE_FAST_MATH", "1")
    r = NVFP4Recipe.from_env()
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode,
            r.nvfp4_4over6_err_use_fast_math) == ("all", "weights", "MSE", True)
    monkeypatch.setenv("NVFP4_4OVER6", "everything")
    with pytest.raises(ValueError, match="NVFP4_4OVER6"):
        NVFP4Recipe.from_env()


def test_4over6_reaches_weights_and_activations_never_gradients():
    from nvfp4_dist.ops import four_over_six_options
    r = NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="weights", nvfp4_4over6_err_mode="MSE")
    assert four_over_six_options("weight", r).e4m3_bound == 256
    assert four_over_six_options("activation", r).e4m3_bound == 448
    assert four_over_six_options("activation", r).err_mode == "MSE"
    assert four_over_six_options("gradient", r) is None
    assert four_over_six_options("activation", NVFP4Recipe(nvfp4_4over6="weights")) is None
