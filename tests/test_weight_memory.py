"""What the NVFP4 layers keep of the weight between forward and backward.

Cached (the default): the WeightCache's copies, of which autograd saves only the columnwise one (dgrad).
keep_quantized_weight=False (the Megatron adapters when every forward requantizes): no copy at all, backward
quantizes the unchanged weight again; outputs and gradients are bit-identical to the cached layer.
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.linear import Linear
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from tests.helpers.distributed import run_distributed

RECIPE = nv.NVFP4Recipe()


def saved_tensors(step):
    """The tensors autograd saves while step() runs its forward."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return out, saved


def storage_pointers(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()}


def test_cached_layer_saves_the_columnwise_weight_copy_only():
    torch.manual_seed(0)
    layer = Linear(64, 48, recipe=RECIPE)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    _, saved = saved_tensors(lambda: layer(x))
    cached = layer.weight_cache.quantized
    pointers = storage_pointers(saved)
    assert storage_pointers([cached.columnwise_data, cached.columnwise_scale]) <= pointers
    assert not storage_pointers([cached.rowwise_data, cached.rowwise_scale]) & pointers


def run_pair(layers, x, dy):
    """Outputs and (x, weight, bias) gradients of layers[0] then layers[1] on x, output gradient dy."""
    x = x.clone().requires_grad_(True)
    hidden = layers[0](x)[0]
    out = layers[1](hidden)[0]
    out.backward(dy)
    grads = [x.grad] + [p.grad for layer in layers for p in (layer.weight, layer.bias)]
    return out.detach(), grads


def build_pair(keep: bool, seed: int = 3, **options):
    torch.manual_seed(seed)
    column = ColumnParallelLinear(64, 96, recipe=options.pop("recipe", RECIPE), **options)
    row = RowParallelLinear(96, 64, recipe=column.recipe, input_is_parallel=True, **options)
    for layer in (column, row):
        layer.keep_quantized_weight = keep
    return column, row


def test_lean_layers_match_cached_and_keep_no_weight_copy():
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    dy = torch.randn(32, 64, dtype=torch.bfloat16)
    cached, lean = build_pair(True), build_pair(False)
    torch.manual_seed(7)  # the SR seeds of backward come from torch's generator
    cached_out, cached_grads = run_pair(cached, x, dy)
    torch.manual_seed(7)
    lean_out, lean_grads = run_pair(lean, x, dy)
    assert torch.equal(lean_out, cached_out)
    for lean_grad, cached_grad in zip(lean_grads, cached_grads):
        assert torch.equal(lean_grad, cached_grad)
    assert all(layer.weight_cache.quantized is None for layer in lean)

    column = lean[0]
    _, saved = saved_tensors(lambda: column(x.clone().requires_grad_(True)))
    weight_copy = nv.quantize(column.weight.detach(), "weight", recipe=RECIPE)
    packed_shapes = {tuple(weight_copy.rowwise_data.shape), tuple(weight_copy.columnwise_data.shape)}
    assert not any(t.dtype == torch.uint8 and tuple(t.shape) in packed_shapes for t in saved)


def test_weight_changed_before_backward_is_refused():
    column, _ = build_pair(False)
    out = column(torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True))[0]
    with torch.no_grad():
        column.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        out.sum().backward()


def _sequence_parallel_overlap_worker(rank, world_size):
    # These small layers too go round the ring, whatever the measured links would choose.
    recipe = nv.NVFP4Recipe(overlap=True, overlap_min_chunk_gflops=0, overlap_measure_links=False)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(world_size * 16, 64, generator=generator).to(torch.bfloat16).chunk(world_size)[rank]
    dy = torch.randn(world_size * 16, 64, generator=generator).to(torch.bfloat16).chunk(world_size)[rank]
    results = []
    for keep in (True, False):
        pair = build_pair(keep, sequence_parallel=True, recipe=recipe)
        torch.manual_seed(7)
        results.append(run_pair(pair, x, dy))
    (cached_out, cached_grads), (lean_out, lean_grads) = results
    assert torch.equal(lean_out, cached_out)
    for lean_grad, cached_grad in zip(lean_grads, cached_grads):
        assert torch.equal(lean_grad, cached_grad)


def test_lean_layers_match_cached_under_sequence_parallel_overlap():
    run_distributed(_sequence_parallel_overlap_worker, 2)
