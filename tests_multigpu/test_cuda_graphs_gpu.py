"""The NVFP4 layers in CUDA graphs (nvfp4_dist.make_graphed_callables: torch.cuda.make_graphed_callables with its
warm-up's checks skipped) on one GPU, and the sync-free eager step.

- Replayed training steps equal eager ones bit for bit over several optimizer steps, stochastic rounding on: the
  SR seed is drawn on the GPU (nvfp4_dist.ops.draw_sr_seed), so every replay draws a new one exactly as the eager
  step does; the weight is quantized inside the graph, so replays see the optimizer's in-place updates.
- A NaN reaching a replayed graph is reported (nvfp4_dist/finite_check.py) at the next optimizer step and by
  raise_pending_nonfinite(), naming the layer.
- Eager steps after the first two run under torch.cuda.set_sync_debug_mode("error"): no host synchronisation.

    python -m pytest -q tests_multigpu/test_cuda_graphs_gpu.py
"""
import copy

import pytest
import torch

import nvfp4_dist as nv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, IN, OUT = 256, 512, 384
STEPS = 4


def make_layer(kind: str, recipe: nv.NVFP4Recipe) -> torch.nn.Module:
    torch.manual_seed(0)
    factory = dict(device="cuda", dtype=torch.bfloat16, recipe=recipe)
    if kind == "linear":
        layer = nv.Linear(IN, OUT, **factory)
    elif kind == "layernorm_linear":
        layer = nv.LayerNormLinear(IN, OUT, **factory)
    else:
        layer = nv.LayerNormMLP(IN, 2 * IN, activation="swiglu" if kind == "layernorm_mlp_swiglu" else "gelu",
                                **factory)
    layer.layer_name = kind
    return layer


def inputs(count: int) -> list:
    generator = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(TOKENS, IN, device="cuda", generator=generator).to(torch.bfloat16).requires_grad_()
            for _ in range(count)]


def train(layer, steps_inputs, step_fn) -> tuple:
    """Losses, input gradients and the parameters after each optimizer step of `step_fn(x) -> output`."""
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    torch.manual_seed(1234)  # the SR seeds drawn from here on
    losses, grads, params = [], [], []
    for x in steps_inputs:
        optimizer.zero_grad(set_to_none=False)
        y = step_fn(x)
        loss = y.float().square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
        grads.append(x.grad.detach().clone())
        params.append([p.detach().clone() for p in layer.parameters()])
    return losses, grads, params


def graphed(layer, sample):
    """make_graphed_callables of `layer` (`sample` becomes its static input: replays copy their input into it);
    the warm-up it runs consumes RNG (train() reseeds)."""
    return nv.make_graphed_callables(layer, (sample,))


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp", "layernorm_mlp_swiglu"])
def test_replayed_steps_equal_eager_steps_bit_for_bit(kind):
    recipe = nv.NVFP4Recipe()  # RHT and stochastic rounding on gradients
    assert recipe.stochastic_rounding
    eager_layer = make_layer(kind, recipe)
    graph_layer = copy.deepcopy(eager_layer)
    steps = inputs(STEPS)
    eager = train(eager_layer, [x.detach().clone().requires_grad_() for x in steps], eager_layer)
    sample = steps[0].detach().clone().requires_grad_()
    replay = train(graph_layer, [x.detach().clone().requires_grad_() for x in steps], graphed(graph_layer, sample))
    for step in range(STEPS):
        assert torch.equal(eager[0][step], replay[0][step]), f"{kind}: loss of step {step}"
        assert torch.equal(eager[1][step], replay[1][step]), f"{kind}: input gradient of step {step}"
        for index, (e, r) in enumerate(zip(eager[2][step], replay[2][step])):
            assert torch.equal(e, r), f"{kind}: parameter {index} after step {step}"
    # The SR seeds advance at every replay: two replays of the same input give different input gradients.
    assert not torch.equal(replay[0][0], replay[0][1])


def test_replays_draw_new_stochastic_rounding_bits():
    """Two replays of the same input and weights: SR makes their gradients differ (a frozen seed would repeat)."""
    layer = make_layer("linear", nv.NVFP4Recipe())
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = inputs(1)[0]
    graph = nv.make_graphed_callables(layer, (x.detach().clone().requires_grad_(),))
    dy = torch.randn(TOKENS, OUT, device="cuda").to(torch.bfloat16)
    grads = []
    for _ in range(2):
        replay_input = x.detach().clone().requires_grad_()
        graph(replay_input).backward(dy)
        grads.append(replay_input.grad.clone())
    assert not torch.equal(grads[0], grads[1])


def test_replay_quantizes_the_updated_weight():
    layer = make_layer("linear", nv.NVFP4Recipe(stochastic_rounding=False))
    sample = inputs(1)[0]
    graph = graphed(layer, sample)
    with torch.no_grad():
        layer.weight.mul_(-0.5)  # an in-place update between replays, as an optimizer makes
    got = graph(sample)
    reference = make_layer("linear", nv.NVFP4Recipe(stochastic_rounding=False))
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
    assert torch.equal(got, reference(sample))


def test_nan_inside_a_replay_is_reported_naming_the_layer():
    layer = make_layer("linear", nv.NVFP4Recipe())
    clean = inputs(1)[0]
    graph = graphed(layer, clean.detach().clone().requires_grad_())
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    sample = clean.detach().clone()
    bad = sample.detach().clone()
    bad[3, 7] = float("nan")
    graph(bad.requires_grad_()).float().sum().backward()
    torch.cuda.synchronize()
    with pytest.raises(nv.NonFiniteAmaxError, match="linear"):
        optimizer.step()  # the pre-step hook reads the record: the bad step is refused
    # reported once; a finite replay after it runs clean
    graph(sample.detach().clone().requires_grad_()).float().sum().backward()
    nv.raise_pending_nonfinite()
    bad2 = sample.detach().clone()
    bad2[0, 0] = float("inf")
    graph(bad2.requires_grad_()).float().sum().backward()
    with pytest.raises(nv.NonFiniteAmaxError, match="linear"):
        nv.raise_pending_nonfinite()


def test_eager_steady_state_step_has_no_host_sync():
    layer = make_layer("linear", nv.NVFP4Recipe())
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    steps = inputs(5)
    for index, x in enumerate(steps):
        if index == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            optimizer.zero_grad(set_to_none=False)
            layer(x).float().square().mean().backward()
            optimizer.step()
        finally:
            if index == len(steps) - 1:
                torch.cuda.set_sync_debug_mode(0)
    nv.raise_pending_nonfinite()
