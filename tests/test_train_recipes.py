"""nvfp4-train's --backward-mode and --recipe-config: refused settings name the flag, the file, the key and the
problem before any process starts; the plan's recipes reach each layer of both models (gloo, TP=2); a glob that
matches no layer stops the job; a run with both trains."""
import importlib.util
import json
import re

import pytest
import torch

from nvfp4_dist import NVFP4Recipe, environment
from nvfp4_dist.launch import cli, plan, spawn, train
from tests.helpers.distributed import run_distributed
from tests.test_train_job import metrics, run_train

RECIPES = {"layers.0.*": "bf16", "*.qkv": {"backward_mode": "dequantized"}, "*.fc2": {"weight_2d": False}}
MEGATRON_RECIPES = {"decoder.layers.1.*": "bf16", "*.self_attention.linear_qkv": {"backward_mode": "dequantized"},
                    "*.mlp.linear_fc2": {"weight_2d": False}}


def write(path, content) -> str:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_backward_modes_of_the_command_line_are_the_recipes():
    assert cli.BACKWARD_MODES == environment.BACKWARD_MODES
    assert cli.OVERLAP_TRANSPORTS == environment.OVERLAP_TRANSPORTS


def test_overlap_transport_flag_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NVFP4_OVERLAP_TRANSPORT", "ring")
    common = ["--device", "cpu", "--out-dir", str(tmp_path / "out"), "--tp", "2", "--sp", "--overlap"]
    flagged = plan.make_plan(cli.build_parser().parse_args([*common, "--overlap-transport", "collectives"]))
    assert flagged.recipe.overlap_transport == "collectives"
    assert plan.make_plan(cli.build_parser().parse_args(common)).recipe.overlap_transport == "ring"
    monkeypatch.delenv("NVFP4_OVERLAP_TRANSPORT")
    assert plan.make_plan(cli.build_parser().parse_args(common)).recipe.overlap_transport == "auto"


@pytest.mark.parametrize("name, content, extra, message", [
    ("r.yaml", '"*.qkv": {rht: maybe}\n', [], "--recipe-config: {path}: key '*.qkv' -> 'rht': rht='maybe' (str): "
                                             "must be of type bool"),
    ("r.json", {"*.qkv": {"nvfp4_4over6": "all"}}, [], "--recipe-config: {path}: key '*.qkv': "
                                                       "nvfp4_4over6='all' cannot be combined with rht=True"),
    ("r.json", {"*.qkv": "fp8"}, [], "--recipe-config: {path}: key '*.qkv': 'fp8' is not a recipe"),
    ("r.json", '{"a": "bf16", "a": {}}', [], "--recipe-config: {path}: key 'a' appears twice"),
    ("r.txt", "", [], "--recipe-config: {path}: unknown recipe config format '.txt'"),
    ("r.json", {}, ["--backward-mode", "bf16"], "argument --backward-mode: invalid choice: 'bf16'"),
    ("r.json", {}, ["--overlap-transport", "collectives"], "--overlap-transport needs --overlap"),
])
def test_bad_recipe_settings_are_refused_before_any_process_starts(tmp_path, capsys, monkeypatch, name, content,
                                                                  extra, message):
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    path = write(tmp_path / name, content)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--device", "cpu", "--out-dir", str(tmp_path / "out"), "--recipe-config", path, *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err, err
    assert err.count("\n") == 1 and err.startswith("nvfp4-train: error: "), err


def test_a_dict_entry_fits_the_recipe_the_flags_make(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = write(tmp_path / "r.json", {"*.qkv": {"nvfp4_4over6": "all"}})
    args = cli.build_parser().parse_args(["--device", "cpu", "--out-dir", str(tmp_path / "out"), "--no-rht",
                                          "--backward-mode", "high_precision", "--recipe-config", path])
    made = plan.make_plan(args)
    assert made.recipe.backward_mode == "high_precision" and not made.recipe.rht
    assert made.recipe_map.resolve("layers.0.qkv", made.recipe) == made.recipe.replace(nvfp4_4over6="all")


def _layers_worker(rank, world_size, directory):
    """Both models built from the plan as the trainer builds them; each layer's recipe after one step."""
    from nvfp4_dist.launch import trainer
    for model_kind, recipes, bf16_layer in (("gpt", RECIPES, 0), ("megatron", MEGATRON_RECIPES, 1)):
        if model_kind == "megatron" and importlib.util.find_spec("megatron") is None:
            continue
        path = write(directory / f"{model_kind}.json", recipes)
        args = cli.build_parser().parse_args(["--device", "cpu", "--nproc", "2", "--model", model_kind,
                                              "--layers", "2", "--backward-mode", "high_precision",
                                              "--out-dir", str(directory / "out"), "--recipe-config", path])
        job = plan.make_plan(args)
        torch.manual_seed(0)
        model, _, _ = trainer.build_model(job, torch.device("cpu"))
        names = trainer.linear_names(model)
        assert len(names) == 8 and job.recipe_map.unmatched(names) == []
        tokens = torch.randint(0, 256, (2, args.seq_length))
        model(tokens, tokens).backward()
        base = NVFP4Recipe.from_env(backward_mode="high_precision", check_finite=True)
        layers = [module for module in model.modules() if getattr(module, "layer_name", None) in names]
        assert len(layers) == 8
        for layer in layers:
            name = layer.layer_name
            if int(re.search(r"layers\.(\d+)\.", name).group(1)) == bf16_layer:
                expected = None
            elif name.endswith("qkv"):
                expected = base.replace(backward_mode="dequantized")
            elif name.endswith("fc2"):
                expected = base.replace(weight_2d=False)
            else:
                expected = base
            assert layer.last_recipe == expected, (model_kind, name, layer.last_recipe)


def test_the_plans_recipes_reach_every_layer_of_both_models(tmp_path):
    run_distributed(_layers_worker, 2, tmp_path)


def test_a_glob_that_matches_no_layer_stops_the_job(tmp_path):
    path = write(tmp_path / "r.yaml", '"layers.0.*": bf16\n"*.self_attention.*": bf16\n')
    result = run_train(tmp_path / "out", "--steps", "1", "--recipe-config", path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"nvfp4-train: error: --recipe-config={path}: '*.self_attention.*' matches none of the gpt model's "
            f"NVFP4 linears (layers.0.qkv, ..., layers.1.fc2)") in result.stderr


def test_a_run_with_per_layer_recipes_and_a_backward_mode_trains(tmp_path):
    path = write(tmp_path / "r.yaml", '"layers.0.*": bf16\n"*.qkv": {backward_mode: high_precision}\n')
    result = run_train(tmp_path / "out", "--steps", "4", "--save-every", "0", "--backward-mode", "dequantized",
                       "--recipe-config", path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backward_mode='dequantized'" in result.stdout and f"per-layer recipes from {path}" in result.stdout
    losses = [r["loss"] for r in metrics(tmp_path / "out")]
    assert len(losses) == 4 and losses[-1] < losses[0]
