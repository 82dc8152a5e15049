"""Megatron-Core's distributed checkpoints (megatron.core.dist_checkpointing, torch_dist backend) saved and loaded
exactly, on real gloo processes (megatron-core's CPU-only needs are patched in the test processes only:
tests/helpers/megatron_checkpoint.py says what and where).

- MoE: the NVFP4 spec's MoE GPTModel (tests/test_moe_megatron.py's: 8 experts, top-2, a shared expert) trained at
  EP=2, saved with `dist_checkpointing.save(model.sharded_state_dict(), dir)` (torch_dist, and with Megatron's
  fully-parallel save and load wrappers over the data-parallel group) and loaded into a fresh model at EP=2:
  every entry of the state dict byte for byte the saved one, and two more training steps give the same losses and
  parameters, bit for bit, as the uninterrupted model. Loaded at EP=1 (Megatron reshards the experts), each global
  expert's weights are the EP=2 rank's that held it, byte for byte, and the model trains as an EP=1 model given
  those weights directly.
- Megatron's distributed optimizer with the NVFP4 param gather (parallel/megatron/param_gather.py) at DP=2: the
  model's and the optimizer's sharded state dicts (Megatron's training loop's save; formats dp_reshardable and
  fully_reshardable, each with and without the fully-parallel wrappers) saved after two steps, loaded into a fresh
  model + optimizer with the option on and with it off: the FP32 main weights, Adam's moments and step and the
  BF16 parameters equal the saved ones byte for byte, and two more steps equal the uninterrupted run (losses, main
  weights and Adam's state, bit for bit). A sharded state dict read before sync_bf16_weights() is refused, and
  Megatron's default format (fully_sharded_model_space) is refused by megatron-core 0.16.1 itself (flattened_range).
"""
import re
import warnings

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from tests.helpers import megatron_checkpoint as ckpt  # noqa: E402
from tests.test_moe_megatron import EXPERTS, gpt, init_megatron, moe_config, train  # noqa: E402


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bytes(got: dict, expected: dict, what: str) -> None:
    """Same keys; each tensor of the same dtype, shape and bytes; each other value equal."""
    assert sorted(got) == sorted(expected), (what, sorted(set(got) ^ set(expected)))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            other = got[key]
            assert isinstance(other, torch.Tensor) and other.dtype == value.dtype and other.shape == value.shape, \
                (what, key)
            assert torch.equal(_bytes(other), _bytes(value)), (what, key, (other.float() - value.float()).abs().max())
        else:
            assert got[key] == value, (what, key, got[key], value)


def _tensors(state_dict) -> dict:
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else value
            for key, value in state_dict.items()}


# ---------------------------------------------------------------------------------------------------------- MoE


def _nvfp4_moe_gpt(ep: int, seed: int):
    from nvfp4_dist.parallel.megatron import NVFP4GroupedMLP, get_gpt_decoder_block_nvfp4_spec
    config = moe_config(ep)
    model = gpt(config, get_gpt_decoder_block_nvfp4_spec(config), seed=seed)
    assert isinstance(model.decoder.layers[1].mlp.experts, NVFP4GroupedMLP)
    return model


def _trained_moe_saved(rank, directory, fully_parallel=False):
    """The EP=2 model after two steps, saved; its state dict at the save."""
    init_megatron(ep=2)
    model = _nvfp4_moe_gpt(2, seed=11)
    train(model, rank, steps=2)
    saved = _tensors(model.state_dict())
    ckpt.save(model.sharded_state_dict(), directory, fully_parallel=fully_parallel)
    return model, saved


def _moe_ep2_worker(rank, world_size, directory, fully_parallel):
    ckpt.dist_checkpointing_on_cpu()
    model, saved = _trained_moe_saved(rank, directory, fully_parallel)
    fresh = _nvfp4_moe_gpt(2, seed=5)
    before = fresh.state_dict()
    assert not torch.equal(before["decoder.layers.1.mlp.experts.linear_fc1.weight0"],
                           saved["decoder.layers.1.mlp.experts.linear_fc1.weight0"])
    state = ckpt.load(fresh.sharded_state_dict(), directory, fully_parallel=fully_parallel)
    fresh.load_state_dict(state)
    assert_same_bytes(_tensors(fresh.state_dict()), saved, f"rank {rank} loaded")
    # The next steps: the same losses and parameters as the model that was never saved (SR seeds drawn alike).
    torch.manual_seed(1234)
    expected = train(model, rank, steps=2)
    torch.manual_seed(1234)
    got = train(fresh, rank, steps=2)
    assert got == expected, (got, expected)
    assert_same_bytes(_tensors(fresh.state_dict()), _tensors(model.state_dict()), f"rank {rank} after 2 steps")


@pytest.mark.parametrize("fully_parallel", [False, True], ids=["torch_dist", "fully_parallel"])
def test_moe_checkpoint_resumes_exactly_ep2(tmp_path, fully_parallel):
    run_distributed(_moe_ep2_worker, 2, tmp_path, fully_parallel)


def _moe_ep2_to_ep1_worker(rank, world_size, directory):
    ckpt.dist_checkpointing_on_cpu()
    model, saved = _trained_moe_saved(rank, directory)
    # The whole model as the EP=1 model names it: each global expert from the EP=2 rank that holds it.
    local = EXPERTS // world_size
    whole = {}
    for key, value in saved.items():
        match = re.fullmatch(r"(.*\.experts\.linear_fc\d\.(?:weight|bias))(\d+)", key)
        if match is None:
            whole[key] = value
            continue
        head, index = match.groups()
        gathered = [torch.empty_like(value) for _ in range(world_size)]
        dist.all_gather(gathered, value.contiguous())
        for owner, tensor in enumerate(gathered):
            whole[f"{head}{owner * local + int(index)}"] = tensor
    del model

    init_megatron(ep=1)
    loaded = _nvfp4_moe_gpt(1, seed=5)
    assert loaded.decoder.layers[1].mlp.experts.num_local_experts == EXPERTS
    state = ckpt.load(loaded.sharded_state_dict(), directory)
    loaded.load_state_dict(state)
    assert_same_bytes(_tensors(loaded.state_dict()), whole, f"rank {rank} loaded at EP=1")
    # It trains as an EP=1 model given those weights directly.
    direct = _nvfp4_moe_gpt(1, seed=6)
    direct.load_state_dict(whole)
    torch.manual_seed(1234)
    expected = train(direct, rank, steps=1)
    torch.manual_seed(1234)
    assert train(loaded, rank, steps=1) == expected


def test_moe_checkpoint_from_ep2_loads_at_ep1(tmp_path):
    run_distributed(_moe_ep2_to_ep1_worker, 2, tmp_path)


# ------------------------------------------------------------------------- distributed optimizer, NVFP4 gather


def _optimizer_inputs(rank, count):
    generator = torch.Generator().manual_seed(200 + rank)
    from tests.test_megatron_param_gather import BATCH, HIDDEN, SEQ
    return [torch.randn(SEQ, BATCH, HIDDEN, generator=generator).to(torch.bfloat16) for _ in range(count)]


def _adam_state(optimizer) -> dict:
    """The FP32 main weights and the inner Adam's state, by position."""
    out = {}
    for i, opt in enumerate(optimizer.chained_optimizers):
        for g, group in enumerate(opt.optimizer.param_groups):
            for p, param in enumerate(group["params"]):
                out[f"{i}.{g}.{p}.main"] = param.detach().clone()
                for key, value in opt.optimizer.state[param].items():
                    out[f"{i}.{g}.{p}.{key}"] = value.detach().clone()
    return out


def _sharded(model, optimizer, sharding, is_loading):
    from tests.test_megatron_param_gather import CpuForCuda
    model_state = model.module.sharded_state_dict()  # Megatron's training loop saves the unwrapped chunk's
    with CpuForCuda():
        optimizer_state = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                       metadata={"distrib_optim_sharding_type": sharding})
    return {"model": model_state, "optimizer": optimizer_state}


def _optimizer_worker(rank, world_size, directory, sharding, fully_parallel):
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from tests.test_megatron_param_gather import CpuForCuda, _build, _init_megatron, _step
    ckpt.dist_checkpointing_on_cpu()
    _init_megatron(1)
    recipe = nv.NVFP4Recipe()
    inputs = _optimizer_inputs(rank, 4)
    model, optimizer, handle = _build(1, recipe, overlap=False, bucket_size=None, nvfp4_gather=True)
    for x in inputs[:2]:
        _step(model, optimizer, x, recipe)
    with pytest.raises(RuntimeError, match="sync_bf16_weights"):
        model.module.sharded_state_dict()
    handle.sync_bf16_weights()
    with pytest.raises(CheckpointingException, match="flattened_range"):  # Megatron's default format, in 0.16.1
        _sharded(model, optimizer, "fully_sharded_model_space", is_loading=False)
    ckpt.save(_sharded(model, optimizer, sharding, is_loading=False), directory, fully_parallel=fully_parallel)
    saved_model, saved_adam = _tensors(model.state_dict()), _adam_state(optimizer)
    assert saved_adam["0.0.0.step"] == 2
    torch.manual_seed(1234)
    expected = [_step(model, optimizer, x, recipe) for x in inputs[2:]]
    expected_adam = _adam_state(optimizer)

    for nvfp4_gather in (True, False):
        fresh, fresh_optimizer, fresh_handle = _build(1, recipe, overlap=False, bucket_size=None,
                                                      nvfp4_gather=nvfp4_gather, seed=5)
        assert not torch.equal(fresh.module.fc1.weight, saved_model["fc1.weight"])
        ckpt.allocate_torch_adam_state(fresh_optimizer)
        state = ckpt.load(_sharded(fresh, fresh_optimizer, sharding, is_loading=True), directory,
                          fully_parallel=fully_parallel)
        fresh.module.load_state_dict(state["model"])
        with CpuForCuda():
            fresh_optimizer.load_state_dict(state["optimizer"])
        what = f"rank {rank} {sharding} nvfp4_gather={nvfp4_gather}"
        assert_same_bytes(_tensors(fresh.state_dict()), saved_model, what)
        assert_same_bytes(_adam_state(fresh_optimizer), saved_adam, what)
        torch.manual_seed(1234)
        got = [_step(fresh, fresh_optimizer, x, recipe) for x in inputs[2:]]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), (what, got, expected)
        assert (getattr(fresh.module.fc1.weight_cache, "gathered", None) is not None) is nvfp4_gather, what
        assert (fresh_handle is not None and fresh_handle.bytes_sent > 0) is nvfp4_gather, what
        assert_same_bytes(_adam_state(fresh_optimizer), expected_adam, what + " after 2 steps")


@pytest.mark.parametrize("sharding, fully_parallel", [("dp_reshardable", False), ("fully_reshardable", False),
                                                      ("dp_reshardable", True), ("fully_reshardable", True)],
                         ids=["dp_reshardable", "fully_reshardable", "dp_reshardable-fully_parallel",
                              "fully_reshardable-fully_parallel"])
def test_distributed_optimizer_checkpoint_resumes_exactly_with_nvfp4_gather_dp2(tmp_path, sharding, fully_parallel):
    run_distributed(_optimizer_worker, 2, tmp_path, sharding, fully_parallel)
