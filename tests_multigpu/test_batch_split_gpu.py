"""split_batch (parallel/megatron/batch_split.py) on 2 and 4 GPUs over each link class: the Megatron GPT decoder block
run as 2 and 4 parts of the micro-batch on as many CUDA streams and NCCL communicators, against the same block run on
each part alone.

Run: `pytest -q tests_multigpu/test_batch_split_gpu.py` (each case launches torchrun on this file), or one world
directly: `torchrun --nproc-per-node 4 tests_multigpu/test_batch_split_gpu.py` with a link class's environment
(`eval "$(python benchmarks/torchrun_setup.py --links slow)"` first). Needs megatron-core and the built kernels.

Expected: the per-token losses are bit-identical (each part is quantized on its own either way; the fused Hopper
GEMM's rows do not depend on how many rows it gets); the gradients agree to the run-to-run noise of the unsplit
block (attention's backward and NCCL's reductions are not bit-reproducible), checked as relative L2 <= GRAD_RTOL,
where a lost part, a wrong group or a race between the streams gives O(1). Also, single-process: wgrads added into
one main_grad from two streams land in order (nvfp4_dist/linear.py).
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, FFN, HEADS, SEQ, BATCH, VOCAB = 2, 1024, 4096, 16, 1024, 4, 4096
GRAD_RTOL = 2e-2


@pytest.mark.parametrize("world_size, links", [(2, "nvlink"), (2, "slow"), (4, "nvlink"), (4, "slow")])
def test_split_batch_matches_each_half_on_gpus(world_size, links):
    pytest.importorskip("megatron.core")
    from tests_multigpu.test_overlap_gpu import link_environment
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    environment = dict(os.environ, **link_environment(links))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               __file__]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert f"batch split GPU checks passed on {world_size} ranks" in result.stdout, result.stdout[-3000:]


def test_main_grad_accumulations_from_two_streams_land_in_order():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from nvfp4_dist.linear import deliver_weight_grad
    weight = torch.nn.Parameter(torch.zeros(4096, 4096, device="cuda"))
    weight.main_grad = torch.zeros(4096, 4096, device="cuda")
    first, second = torch.cuda.Stream(), torch.cuda.Stream()

    def add(value, delay):
        def compute(buffer):
            torch.cuda._sleep(delay)  # the first stream's read-modify-write is still pending when the second starts
            buffer.mul_(2).add_(value)
        return compute

    with torch.cuda.stream(first):
        deliver_weight_grad(weight, add(1.0, 50_000_000), accumulate_into_main_grad=True, delayed=False)
    with torch.cuda.stream(second):
        deliver_weight_grad(weight, add(3.0, 0), accumulate_into_main_grad=True, delayed=False)
    torch.cuda.synchronize()
    assert torch.equal(weight.main_grad, torch.full_like(weight.main_grad, 5.0))  # (0 * 2 + 1) * 2 + 3


# ----------------------------------------------------------------------------------------------------------
# Per-rank checks (run under torchrun).

def build(tp):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nvfp4_dist import NVFP4Recipe
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp, sequence_parallel=True, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False)
    # Overlap on (the layers' own pipelining runs inside each half); no stochastic rounding: its seeds are drawn in
    # backward order, which the two streams change.
    recipe = NVFP4Recipe(overlap=True, overlap_min_chunk_gflops=0, stochastic_rounding=False, fused_producers=True)
    spec = get_gpt_decoder_block_nvfp4_spec(config, recipe=recipe, bf16_first_layers=0, bf16_last_layers=0,
                                            sdpa_attention=True)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope").cuda()


def losses(model, tokens, rows):
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(rows.stop - rows.start, -1)
    out = model(tokens[rows, :-1], positions, None, labels=tokens[rows, 1:])
    out.float().sum().backward()
    return out.detach()


def relative_l2(got, expected):
    return ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def main():
    from megatron.core import parallel_state
    from nvfp4_dist.parallel.megatron import split_batch
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        generator = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator).cuda()
        reference = build(tp)
        per_sample = [losses(reference, tokens, slice(i, i + 1)) for i in range(BATCH)]
        singles = dict(reference.named_parameters())
        pairs = build(tp)
        in_pairs = torch.cat([losses(pairs, tokens, slice(0, 2)), losses(pairs, tokens, slice(2, 4))])
        worst = (0.0, "")
        for parts, expected, wanted in ((2, in_pairs, dict(pairs.named_parameters())),
                                        (4, torch.cat(per_sample), singles)):
            split = build(tp)
            split_batch(split, parts)
            for step in range(2):  # the second step reuses the twin communicators, streams and quantized weights
                split.zero_grad()
                got = losses(split, tokens, slice(0, BATCH))
                assert torch.equal(got, expected), \
                    f"{parts} parts, step {step}: max loss diff {(got - expected).abs().max().item()}"
            worst = max(worst, *((relative_l2(p.grad, wanted[n].grad), f"{parts} parts: {n}")
                                 for n, p in split.named_parameters()))
            assert worst[0] <= GRAD_RTOL, worst
            del split
        torch.cuda.synchronize()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"largest gradient relative L2 {worst[0]:.2e} ({worst[1]})")
            print(f"batch split GPU checks passed on {tp} ranks", flush=True)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
