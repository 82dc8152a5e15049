"""Tensor-parallel NVFP4 layers in CUDA graphs (nvfp4_dist.make_graphed_callables), NCCL collectives inside the
graphs, on 2 or 4 GPUs.

- A column-parallel then row-parallel pair with sequence parallelism, stochastic rounding on: replayed training
  steps equal eager ones bit for bit over several optimizer steps (losses, input gradients, parameters), on every
  rank.
- A NaN reaching one rank's replay is reported on every rank (the group's amax all-reduce is in the graph): each
  rank's next optimizer step is refused.
- recipe.overlap=True is refused inside a capture with a one-line error naming the layer.

    torchrun --nproc-per-node 2 -m pytest tests_multigpu/test_cuda_graphs_tp_gpu.py -q
    torchrun --nproc-per-node 4 -m pytest tests_multigpu/test_cuda_graphs_tp_gpu.py -q
"""
import copy

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from tests_multigpu.test_cuda_graphs_gpu import train

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs GPUs"),
              pytest.mark.usefixtures("nccl_group")]

HIDDEN, FFN, TOKENS_PER_RANK, STEPS = 256, 512, 128, 4


class Block(torch.nn.Module):
    """fc1 (column-parallel, SP: gathers the tokens) then fc2 (row-parallel, SP: reduce-scatters them)."""

    def __init__(self, recipe: nv.NVFP4Recipe):
        super().__init__()
        factory = dict(sequence_parallel=True, recipe=recipe, params_dtype=torch.bfloat16, device="cuda")
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, **factory)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, **factory)
        self.fc1.layer_name, self.fc2.layer_name = "fc1", "fc2"

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)[0]))[0]


def make_block(recipe: nv.NVFP4Recipe) -> Block:
    torch.manual_seed(0)
    return Block(recipe)


def inputs(count: int) -> list:
    generator = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())  # each rank's own tokens
    return [torch.randn(TOKENS_PER_RANK, HIDDEN, device="cuda", generator=generator).to(torch.bfloat16)
            for _ in range(count)]


def test_replayed_tensor_parallel_steps_equal_eager_steps_bit_for_bit():
    recipe = nv.NVFP4Recipe(overlap=False)
    assert recipe.stochastic_rounding
    eager_block = make_block(recipe)
    graph_block = copy.deepcopy(eager_block)
    steps = inputs(STEPS)
    eager = train(eager_block, [x.detach().clone().requires_grad_() for x in steps], eager_block)
    graphed = nv.make_graphed_callables(graph_block, (steps[0].detach().clone().requires_grad_(),))
    replay = train(graph_block, [x.detach().clone().requires_grad_() for x in steps], graphed)
    for step in range(STEPS):
        assert torch.equal(eager[0][step], replay[0][step]), f"rank {dist.get_rank()}: loss of step {step}"
        assert torch.equal(eager[1][step], replay[1][step]), f"rank {dist.get_rank()}: input gradient of step {step}"
        for index, (e, r) in enumerate(zip(eager[2][step], replay[2][step])):
            assert torch.equal(e, r), f"rank {dist.get_rank()}: parameter {index} after step {step}"


def test_nan_on_one_rank_inside_a_replay_is_reported_on_every_rank():
    block = make_block(nv.NVFP4Recipe(overlap=False))
    clean = inputs(1)[0]
    graphed = nv.make_graphed_callables(block, (clean.detach().clone().requires_grad_(),))
    optimizer = torch.optim.SGD(block.parameters(), lr=1e-3)
    bad = clean.detach().clone()
    if dist.get_rank() == 0:
        bad[3, 7] = float("nan")
    graphed(bad.requires_grad_()).float().sum().backward()
    torch.cuda.synchronize()
    with pytest.raises(nv.NonFiniteAmaxError, match="fc1|fc2"):
        optimizer.step()
    dist.barrier()


def test_overlap_is_refused_inside_a_capture_naming_the_layer():
    block = make_block(nv.NVFP4Recipe(overlap=True))
    sample = inputs(1)[0].requires_grad_()
    with pytest.raises(RuntimeError, match="overlap=True cannot be captured"):
        nv.make_graphed_callables(block, (sample,))
    dist.barrier()
