"""Megatron-Core's DistributedDataParallel + distributed optimizer gathering the NVFP4 linears' weights in NVFP4
(nvfp4_dist.parallel.megatron.param_gather), on real gloo groups: DP=2, DP=4 and DP=2 x TP=2.

The gathered weight equals quantizing the whole weight byte for byte; training with the NVFP4 gather equals training
with Megatron's own gather followed by the layers' quantization, step for step (losses and FP32 main weights, bit
for bit); the state dict after a sync equals the one without the option, a stale one is refused, a load drops the
gathered copy; unaligned weights are refused at set-up.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from tests.helpers.benchmarks import load_benchmark_module
from tests.helpers.distributed import run_distributed
from tests.test_parallel_comm import assert_bytes_equal

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
_ON_CPU = load_benchmark_module("megatron_on_cpu")  # Megatron's CUDA assumptions mapped to the CPU
CpuForCuda, _init_megatron = _ON_CPU.CpuForCuda, _ON_CPU.init_megatron

HIDDEN, FFN, SEQ, BATCH, STEPS = 64, 256, 16, 2, 3


def _config(tp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=tp,
                             use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                             gradient_accumulation_fusion=False, init_method_std=0.05)


def _net(config, recipe):
    from megatron.core.transformer.module import MegatronModule
    from nvfp4_dist.parallel.megatron import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear

    class Net(MegatronModule):
        """fc1 (column), fc2 (row), a BF16 head: NVFP4 weights beside parameters that stay in BF16."""

        def __init__(self):
            super().__init__(config)
            self.fc1 = NVFP4ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=config.init_method,
                                                 bias=True, recipe=recipe)
            self.fc2 = NVFP4RowParallelLinear(FFN, HIDDEN, config=config, init_method=config.init_method, bias=True,
                                              input_is_parallel=True, skip_bias_add=False, recipe=recipe)
            self.head = NVFP4ColumnParallelLinear(HIDDEN, 32, config=config, init_method=config.init_method,
                                                  bias=False, gather_output=True, bf16_fallback=True)

        def forward(self, x):
            hidden, _ = self.fc1(x)
            y, _ = self.fc2(torch.nn.functional.gelu(hidden))
            return self.head(y)[0]
    return Net()


def _build(tp, recipe, *, overlap, bucket_size, nvfp4_gather, seed=0):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from nvfp4_dist.parallel.megatron import enable_nvfp4_param_gather
    config = _config(tp)
    torch.manual_seed(seed)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=overlap,
                                               overlap_grad_reduce=overlap, bucket_size=bucket_size)
    model = DistributedDataParallel(config, ddp_config, _net(config, recipe))
    with CpuForCuda():
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.0,
                                                           use_distributed_optimizer=True), [model])
    handle = enable_nvfp4_param_gather([model]) if nvfp4_gather else None
    return model, optimizer, handle


def _step(model, optimizer, x, recipe):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with nv.autocast(recipe):
        loss = model(x).float().square().mean()
    loss.backward()
    model.finish_grad_sync()
    with CpuForCuda():
        optimizer.step()
    return loss.detach()


def _main_weights(optimizer):
    return [t.clone() for opt in optimizer.chained_optimizers for group in opt.shard_fp32_from_float16_groups
            for t in group]


def _inputs(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(SEQ, BATCH, HIDDEN, generator=generator).to(torch.bfloat16) for _ in range(STEPS)]


def _train_equals_bf16_gather(rank, world_size, tp, overlap, bucket_size, weight_2d):
    """Losses and FP32 main weights equal, bit for bit, with and without the NVFP4 gather; the gathered copies equal
    quantizing the whole weights; the NVFP4 gather moved fewer bytes than Megatron's BF16 gather of the same
    buckets."""
    _init_megatron(tp)
    recipe = nv.NVFP4Recipe(weight_2d=weight_2d)
    inputs = _inputs(rank // tp)  # the TP ranks of a replica share its data
    runs = []
    for nvfp4_gather in (False, True):
        model, optimizer, handle = _build(tp, recipe, overlap=overlap, bucket_size=bucket_size,
                                          nvfp4_gather=nvfp4_gather)
        losses = [_step(model, optimizer, x, recipe) for x in inputs]
        runs.append((losses, _main_weights(optimizer), model, handle))
    (losses, mains, _, _), (nv_losses, nv_mains, model, handle) = runs
    for step, (a, b) in enumerate(zip(losses, nv_losses)):
        assert torch.equal(a, b), (step, a, b)
    assert len(mains) == len(nv_mains) and all(torch.equal(a, b) for a, b in zip(mains, nv_mains))
    assert sorted(handle.layers) == ["fc1", "fc2"]
    if overlap:  # the last step's gather runs in the next forward's pre-hooks
        for bucket_group in model.bucket_groups:
            bucket_group.finish_param_sync()
    layers = [model.module.fc1, model.module.fc2]
    gathered = [layer.weight_cache.gathered for layer in layers]
    assert all(q is not None for q in gathered)
    # Megatron's BF16 gather would move every bucket's shard; the NVFP4 gather moved less.
    bf16_bytes = sum(bucket.param_data.numel() // (world_size // tp) * 2
                     for group in handle.groups for bucket, _ in group.buckets)
    per_gather = handle.bytes_sent / (STEPS + (1 if overlap else 0))
    assert per_gather < 0.75 * bf16_bytes, (per_gather, bf16_bytes)
    handle.sync_bf16_weights()
    for layer, q in zip(layers, gathered):
        expected = nv.quantize(layer.weight.detach(), role="weight", recipe=recipe)
        assert_bytes_equal(q, expected, (layer.layer_name, rank))


CASES = [(2, 1, True, 6000, True), (2, 1, False, None, False), (4, 1, False, None, True), (4, 2, True, 6000, True)]


@pytest.mark.parametrize("world_size, tp, overlap, bucket_size, weight_2d", CASES,
                         ids=["dp2-overlap", "dp2-1x16", "dp4", "dp2xtp2-overlap"])
def test_training_equals_the_bf16_gather(world_size, tp, overlap, bucket_size, weight_2d):
    run_distributed(_train_equals_bf16_gather, world_size, tp, overlap, bucket_size, weight_2d)


def _checkpoint(rank, world_size):
    """A state dict of stale weights is refused; after sync_bf16_weights it equals the one without the option; a
    load drops the gathered copies, and the next forward equals the model's without the option."""
    _init_megatron(1)
    recipe = nv.NVFP4Recipe()
    inputs = _inputs(rank)
    plain, plain_opt, _ = _build(1, recipe, overlap=False, bucket_size=None, nvfp4_gather=False)
    for x in inputs[:2]:  # one model trained after the other (as the training tests do)
        _step(plain, plain_opt, x, recipe)
    model, optimizer, handle = _build(1, recipe, overlap=False, bucket_size=None, nvfp4_gather=True)
    for x in inputs[:2]:
        _step(model, optimizer, x, recipe)
    with pytest.raises(RuntimeError, match=r"fc1.weight: this rank holds only its own rows .* sync_bf16_weights"):
        model.state_dict()
    handle.sync_bf16_weights()
    expected, got = plain.state_dict(), model.state_dict()
    assert expected.keys() == got.keys()
    bad = [key for key in expected if isinstance(expected[key], torch.Tensor) and not torch.equal(expected[key], got[key])]
    assert not bad, (bad, [(expected[k] - got[k]).abs().max() for k in bad])
    # Load other weights into the model with the option: it runs on them as the model without it does.
    _step(model, optimizer, inputs[2], recipe)
    assert model.module.fc1.weight_cache.gathered is not None
    fresh, _, _ = _build(1, recipe, overlap=False, bucket_size=None, nvfp4_gather=False, seed=7)
    model.load_state_dict(fresh.state_dict())
    assert model.module.fc1.weight_cache.gathered is None
    with nv.autocast(recipe), torch.no_grad():
        assert torch.equal(model(inputs[0]), fresh(inputs[0]))


def test_checkpoint_state_is_megatrons():
    run_distributed(_checkpoint, 2)


def _unaligned(rank, world_size):
    _init_megatron(1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from nvfp4_dist.parallel.megatron import enable_nvfp4_param_gather
    config = _config(1)
    net = _net(config, nv.NVFP4Recipe())
    net.fc2.weight = torch.nn.Parameter(torch.zeros(40, FFN, dtype=torch.bfloat16))  # not a multiple of 16 rows
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), net)
    with pytest.raises(ValueError, match=r"fc2.weight.shape=\(40, 256\): 40 rows .* multiple of 16"):
        enable_nvfp4_param_gather(model)
    assert model.module.fc1.weight_cache.__class__ is nv.linear.WeightCache  # nothing changed
    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        enable_nvfp4_param_gather(DistributedDataParallel(config, DistributedDataParallelConfig(),
                                                          _net(config, None)))
    with pytest.raises(ValueError, match="DistributedDataParallel model chunks"):
        enable_nvfp4_param_gather(net)
    dist.barrier()


def test_unaligned_weights_refused():
    run_distributed(_unaligned, 2)


def _nonfinite(rank, world_size):
    """A NaN in one rank's main weights (the optimizer step writes it into the parameters): the NVFP4 gather after
    that step raises NonFiniteAmaxError naming the weight on every rank (the all-reduced amax is +inf everywhere)."""
    _init_megatron(1)
    recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    model, optimizer, _ = _build(1, recipe, overlap=False, bucket_size=None, nvfp4_gather=True)
    inputs = _inputs(rank)
    _step(model, optimizer, inputs[0], recipe)
    if rank == 1:
        with torch.no_grad():
            for group in optimizer.chained_optimizers[0].shard_fp32_from_float16_groups:
                for main in group:
                    main.view(-1)[0] = float("nan")
    with pytest.raises(nv.NonFiniteAmaxError, match=r"param gather: fc[12] is not finite"):
        _step(model, optimizer, inputs[1], recipe)


def test_nonfinite_weight_is_reported_by_the_gather():
    run_distributed(_nonfinite, 2)
