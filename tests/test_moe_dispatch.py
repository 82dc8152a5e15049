"""NVFP4 MoE dispatch (recipe moe_dispatch="nvfp4", parallel/moe_dispatch.py, docs/numerics.md §13) on gloo.

- At EP=2 and EP=4 the bytes each rank receives equal, byte for byte, quantizing the sender's tokens locally (one
  amax per token), and the gradient goes back to the rows it came from.
- The MoE layer (NVFP4MoELayer with NVFP4GroupedMLP experts, Megatron's alltoall dispatcher) with NVFP4 dispatch at
  EP=2 and EP=4 gives, on each rank, the output rows that one process computes for all ranks' tokens with all
  experts (the same layer at EP=1); without stochastic rounding also the same expert weight gradients and input
  gradients. NVFP4 dispatch changes the result against BF16 dispatch (the path is taken), and is refused with the
  allgather dispatcher.
"""
import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import ops
from nvfp4_dist.parallel import moe_dispatch
from tests.helpers.distributed import run_distributed

HIDDEN = 64


def _tokens(rank: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(40 + rank)
    scale = torch.exp(torch.randn(rows, 1, generator=generator))  # tokens of very different magnitudes
    return (torch.randn(rows, HIDDEN, generator=generator) * scale).to(torch.bfloat16)


def _split_matrix(world: int) -> list[list[int]]:
    """rows[src][dst] that rank src sends to rank dst (some zero)."""
    return [[(3 * src + 5 * dst) % 7 for dst in range(world)] for src in range(world)]


def _dispatch_worker(rank, world_size):
    recipe = nv.NVFP4Recipe(moe_dispatch="nvfp4")
    splits = _split_matrix(world_size)
    sent = splits[rank]
    received_from = [splits[src][rank] for src in range(world_size)]
    tokens = _tokens(rank, sum(sent)).requires_grad_()
    values, received = moe_dispatch.dispatch_nvfp4(tokens, recipe, dist.group.WORLD, received_from, sent)
    assert received.row_scaled and tuple(received.shape) == (sum(received_from), HIDDEN)
    start = 0
    for src in range(world_size):
        source = _tokens(src, sum(splits[src]))
        local = ops.quantize(source, "activation", rowwise=True, columnwise=False,
                             recipe=recipe.replace(row_scaled_activation=True))
        first = sum(splits[src][:rank])
        count = received_from[src]
        rows = slice(start, start + count)
        assert torch.equal(received.rowwise_data[rows], local.rowwise_data[first:first + count])
        assert torch.equal(received.rowwise_scale[rows].view(torch.uint8),
                           local.rowwise_scale[first:first + count].view(torch.uint8))
        assert torch.equal(received.amax_rowwise[rows], local.amax_rowwise[first:first + count])
        start += count
    assert torch.equal(values, ops.dequantize(received, dtype=torch.bfloat16))
    # Backward: each received row's gradient returns to the sender's row, unquantized.
    weights = torch.arange(values.numel(), dtype=torch.float32).reshape(values.shape).to(torch.bfloat16) + rank
    (values * weights).float().sum().backward()
    offset = 0
    for dst in range(world_size):
        sent_rows = slice(offset, offset + sent[dst])
        start = sum(splits[src][dst] for src in range(rank))
        expected = torch.arange(start * HIDDEN, (start + sent[dst]) * HIDDEN, dtype=torch.float32)
        expected = expected.reshape(-1, HIDDEN).to(torch.bfloat16) + dst
        assert torch.equal(tokens.grad[sent_rows], expected)
        offset += sent[dst]


@pytest.mark.parametrize("world", [2, 4])
def test_dispatched_bytes_equal_local_quantization(world):
    run_distributed(_dispatch_worker, world)


def test_row_bytes_and_the_byte_ratio():
    assert moe_dispatch.row_bytes(4096) == 2048 + 256 + 4
    nvfp4 = moe_dispatch.dispatch_bytes(16384, 4096, "nvfp4")
    bf16 = moe_dispatch.dispatch_bytes(16384, 4096, "bf16")
    assert nvfp4 / bf16 == pytest.approx(0.5625 / 2 + 2 / 4096)
    q = moe_dispatch.quantize_tokens(_tokens(0, 32), nv.NVFP4Recipe())
    packed = moe_dispatch.pack_rows(q)
    assert packed.dtype == torch.uint8 and packed.shape == (32, moe_dispatch.row_bytes(HIDDEN))
    back = moe_dispatch.unpack_rows(packed, HIDDEN, torch.bfloat16)
    for name in ("rowwise_data", "amax_rowwise"):
        assert torch.equal(getattr(back, name), getattr(q, name))
    with pytest.raises(ValueError, match="mode='fp8'"):
        moe_dispatch.dispatch_bytes(1, 16, "fp8")


SEQ, BATCH, EXPERTS = 16, 2, 8


def _moe_layer(ep: int, recipe, dispatcher: str = "alltoall"):
    from megatron.core.transformer.spec_utils import build_module
    from nvfp4_dist.parallel.megatron import NVFP4MoELayer, get_gpt_layer_nvfp4_spec
    from tests.test_moe_megatron import init_megatron, moe_config
    init_megatron(ep=ep)
    config = moe_config(ep, dispatcher, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                        moe_shared_expert_intermediate_size=None)
    spec = get_gpt_layer_nvfp4_spec(recipe=recipe, num_experts=EXPERTS).submodules.mlp
    torch.manual_seed(21)
    layer = build_module(spec, config=config)
    assert isinstance(layer, NVFP4MoELayer)
    return layer


def _inputs(rank: int):
    generator = torch.Generator().manual_seed(60 + rank)
    hidden = torch.randn(SEQ, BATCH, 64, generator=generator).to(torch.float32)
    grad = torch.randn(SEQ, BATCH, 64, generator=generator)
    return hidden, grad


def _run(layer, hidden, grad):
    hidden = hidden.clone().requires_grad_()
    output, _ = layer(hidden)
    output.backward(grad)
    return output.detach(), hidden.grad


def _layer_worker(rank, world_size):
    results = {}
    for name, recipe in (("default", nv.NVFP4Recipe(moe_dispatch="nvfp4")),
                         ("no_sr", nv.NVFP4Recipe(moe_dispatch="nvfp4", stochastic_rounding=False)),
                         ("bf16_dispatch", nv.NVFP4Recipe(stochastic_rounding=False))):
        # The single-process oracle: every rank's tokens (concatenated along the sequence) through all experts.
        oracle = _moe_layer(1, recipe)
        pieces = [_inputs(r) for r in range(world_size)]
        oracle_out, oracle_grad = _run(oracle, torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]))
        layer = _moe_layer(world_size, recipe)
        out, grad = _run(layer, *pieces[rank])
        rows = slice(rank * SEQ, (rank + 1) * SEQ)
        assert torch.equal(out, oracle_out[rows]), name
        local = EXPERTS // world_size
        if name != "default":  # SR off: the gradients too (stochastic rounding draws per expert row offsets)
            assert torch.equal(grad, oracle_grad[rows]), name
            for linear in ("linear_fc1", "linear_fc2"):
                for index in range(local):
                    mine = getattr(getattr(layer.experts, linear), f"weight{index}")
                    theirs = getattr(getattr(oracle.experts, linear), f"weight{rank * local + index}")
                    assert torch.equal(mine, theirs)
                    assert torch.equal(mine.grad, theirs.grad), (name, linear, index)
        results[name] = out
    assert not torch.equal(results["no_sr"], results["bf16_dispatch"])

    layer = _moe_layer(world_size, nv.NVFP4Recipe(moe_dispatch="nvfp4"), dispatcher="allgather")
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='alltoall'"):
        layer(_inputs(rank)[0])


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_with_nvfp4_dispatch_equals_single_process_oracle(world):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    run_distributed(_layer_worker, world, timeout_s=600)
