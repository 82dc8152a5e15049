"""split_batch on CPU (gloo, TP=2, sequence parallel): the decoder block run as parts of the micro-batch equals
the unsplit block run on each part separately, over twin groups of the same ranks; what it cannot split runs
whole, and what it cannot run is refused."""
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from tests.test_megatron import SEQ, TP, VOCAB, _config, _gpt, _init_megatron  # noqa: E402

BATCH = 3  # parts of 2 and 1 samples, or 1 each


def _tokens(batch):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).unsqueeze(0).expand(batch, SEQ)


def _losses(model, rows, mask):
    """Per-token losses [b, s] of the samples `rows`; their sum's gradients accumulate into .grad."""
    tokens, labels, positions = _tokens(BATCH)
    losses = model(tokens[rows], positions[rows], mask, labels=labels[rows])
    losses.float().sum().backward()
    return losses.detach()


def _nvfp4_gpt(config, seed=11):
    """Layer 0 in BF16, layer 1 in NVFP4 without stochastic rounding (its seeds are drawn in backward order)."""
    from nvfp4_dist import NVFP4Recipe
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec
    spec = get_gpt_decoder_block_nvfp4_spec(config, recipe=NVFP4Recipe(stochastic_rounding=False), bf16_first_layers=1,
                                            fused_producers=True)
    return _gpt(config, spec, seed)


def _split_worker(rank, world_size):
    import torch.distributed as dist
    from nvfp4_dist.parallel.layers import _ParallelLinear
    from nvfp4_dist.parallel.megatron import split_batch
    from nvfp4_dist.parallel.megatron.batch_split import BatchSplitTransformerBlock
    from megatron.core.transformer.transformer_block import TransformerBlock
    _init_megatron(TP)
    config = _config(gated_linear_unit=True, sequence_parallel=True, num_layers=2)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    every = slice(0, BATCH)
    reference = _nvfp4_gpt(config)
    per_sample = [_losses(reference, slice(i, i + 1), causal) for i in range(BATCH)]
    references = dict(reference.named_parameters())

    for parts, expected in ((2, torch.cat([per_sample[0], per_sample[1], per_sample[2]])), (3, None)):
        split = _nvfp4_gpt(config)
        block = split_batch(split, parts)
        assert isinstance(block, BatchSplitTransformerBlock) and block is split.decoder
        linears = [m for m in block.modules() if isinstance(m, _ParallelLinear)]
        original = linears[0].tp_group
        assert block._groups[0] is original and len(block._groups) == parts
        assert len({id(g) for g in block._groups}) == parts
        assert all(dist.get_process_group_ranks(g) == dist.get_process_group_ranks(original) for g in block._groups)
        if parts == 2:  # parts of 2 and 1 samples: the reference on samples 0-1 together, then on sample 2
            whole = _nvfp4_gpt(config)
            expected = torch.cat([_losses(whole, slice(0, 2), causal), _losses(whole, slice(2, 3), causal)])
            wanted = dict(whole.named_parameters())
        else:  # one sample per part
            expected, wanted = torch.cat(per_sample), references
        got = _losses(split, every, causal)
        assert torch.equal(got, expected), (parts, (got - expected).abs().max())
        assert all(m.tp_group is original for m in linears)  # a twin group only while its part runs
        assert all(g in m._comms_over for m in linears for g in block._groups[1:])
        for name, param in split.named_parameters():
            if name.startswith("decoder.") and parts == 2:  # two parts' gradients, added once either way
                assert torch.equal(param.grad, wanted[name].grad), (parts, name)
            else:  # three parts' sums associate in another order; embedding and output layer: one GEMM
                torch.testing.assert_close(param.grad, wanted[name].grad, rtol=1e-5, atol=1e-6, msg=name)

    # A mask with the batch dim is split with the hidden states: the same losses.
    assert torch.equal(_losses(split, every, causal.expand(BATCH, 1, SEQ, SEQ).contiguous()), expected)
    # One sample runs whole: the reference's losses for it.
    assert torch.equal(_losses(split, slice(0, 1), causal), per_sample[0])
    # Calls that run whole: cross-attention context, packed sequences, a batch-first tensor of another batch size.
    hidden = torch.zeros(SEQ // TP, 4, 8)
    assert block._parts(hidden, {"extract_layer_indices": set()}) is not None
    for arguments in ({"context": torch.zeros(1)}, {"packed_seq_params": object()},
                      {"attention_mask": torch.zeros(3, 1, SEQ, SEQ)}):
        assert block._parts(hidden, arguments) is None, arguments
    parts = block._parts(hidden, {"attention_mask": torch.zeros(4, 1, SEQ, SEQ)})
    assert [tuple(h.shape) for h, _ in parts] == [(SEQ // TP, 2, 8), (SEQ // TP, 1, 8), (SEQ // TP, 1, 8)]
    assert [tuple(a["attention_mask"].shape) for _, a in parts] == [(2, 1, SEQ, SEQ), (1, 1, SEQ, SEQ),
                                                                     (1, 1, SEQ, SEQ)]
    # Wrappers with a .module (Megatron's DDP, Float16Module) are looked through.
    wrapper = torch.nn.Module()
    wrapper.module = split
    assert split_batch(wrapper, 3) is block
    # parts=1 gives Megatron's block back; the twins are kept for the next split.
    twins = block._groups[1:]
    assert type(split_batch(split, 1)) is TransformerBlock
    assert split_batch(split, 3)._groups[1:] == twins
    with pytest.raises(ValueError, match="parts=0"):
        split_batch(split, 0)

    # Refused: Megatron's own linears, activation recomputation.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from nvfp4_dist.parallel.megatron import NVFP4Norm, with_sequence_parallel_norm
    local = _gpt(config, TransformerBlockSubmodules(layer_specs=[with_sequence_parallel_norm(
        get_gpt_layer_local_spec())] * 2, layer_norm=NVFP4Norm), seed=11)
    with pytest.raises(ValueError, match="Megatron's own linears"):
        split_batch(local)
    recomputed = _nvfp4_gpt(_config(gated_linear_unit=True, sequence_parallel=True, num_layers=2,
                                    recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1))
    with pytest.raises(ValueError, match="recompute_granularity='full'"):
        split_batch(recomputed)
    with pytest.raises(ValueError, match="not Megatron's TransformerBlock"):
        split_batch(torch.nn.Linear(2, 2))


def test_split_batch_equals_each_part_run_alone():
    run_distributed(_split_worker, TP)
