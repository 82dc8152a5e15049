"""Megatron-Core MoE with NVFP4 experts on CPU (gloo): NVFP4GroupedMLP in the decoder-block spec.

- A GPTModel of 4 layers (one dense, three MoE: 8 experts, top-2, a shared expert; hidden 64) trains through
  Megatron's get_forward_backward_func with Megatron's alltoall and allgather token dispatchers, at EP=1 and EP=2
  on 2 processes: the loss decreases, the gradients of the non-expert parameters (allreduce=True) are averaged over
  the data-parallel group and the experts' (allreduce=False) are not.
- In BF16 fallback the model is Megatron's own local MoE model: the same initial weights (each global expert's
  weights drawn in order), the same loss and gradients.
- The experts' distributed-checkpoint entries are SequentialMLP's (keys, global offsets and shapes).
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from tests.helpers.benchmarks import load_benchmark_module
from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

HIDDEN, FFN, MOE_FFN, HEADS, VOCAB, SEQ, BATCH, EXPERTS = 64, 128, 64, 4, 128, 32, 2, 8


_ON_CPU = load_benchmark_module("megatron_on_cpu")  # Megatron's CUDA assumptions mapped to the CPU
megatron_moe_on_cpu = _ON_CPU.megatron_moe_on_cpu


def init_megatron(ep: int, tp: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state
    megatron_moe_on_cpu()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)


def moe_config(ep: int, dispatcher: str = "alltoall", **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    settings = dict(num_layers=4, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                    use_cpu_initialization=True, add_bias_linear=False, bias_activation_fusion=False,
                    bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05, gated_linear_unit=True,
                    activation_func=torch.nn.functional.silu, num_moe_experts=EXPERTS, moe_router_topk=2,
                    moe_ffn_hidden_size=MOE_FFN, moe_token_dispatcher_type=dispatcher, moe_layer_freq=[0, 1, 1, 1],
                    expert_model_parallel_size=ep, moe_aux_loss_coeff=0.01,
                    moe_router_load_balancing_type="aux_loss", moe_shared_expert_intermediate_size=MOE_FFN)
    settings.update(overrides)
    return TransformerConfig(**settings)


def gpt(config, spec, seed: int = 11):
    from megatron.core.models.gpt.gpt_model import GPTModel
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def batches(rank: int, count: int):
    """`count` micro-batches of rank-specific tokens (each data-parallel rank sees its own data)."""
    generator = torch.Generator().manual_seed(100 + rank)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1), "position_ids": position_ids,
                    "attention_mask": mask})
    return out


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


def reduce_gradients(model) -> None:
    """Megatron's gradient-reduction rule: sum over the data-parallel group the gradients of the parameters marked
    allreduce (the default), over the expert data-parallel group the others (whose experts saw the tokens of every
    rank of the expert-parallel group already); both divided by the data-parallel size: the global batch's mean."""
    from megatron.core import parallel_state
    dense = parallel_state.get_data_parallel_group()
    expert = parallel_state.get_expert_data_parallel_group()
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, group=dense if getattr(param, "allreduce", True) else expert)
        param.grad /= dist.get_world_size(dense)


def train(model, rank: int, steps: int, micro_batches: int = 2, lr: float = 3e-3) -> list[float]:
    """Steps of Megatron's no-pipelining schedule on the same micro-batches; the loss of each step."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    data = batches(rank, micro_batches)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                                              num_microbatches=micro_batches, seq_length=SEQ,
                                              micro_batch_size=BATCH, forward_only=False)
        loss = torch.stack([entry["lm loss"] for entry in outputs]).mean()
        dist.all_reduce(loss)
        losses.append(float(loss) / dist.get_world_size())
        reduce_gradients(model)
        optimizer.step()
    return losses


def _training_worker(rank, world_size, dispatcher):
    from nvfp4_dist.parallel.megatron import NVFP4GroupedMLP, get_gpt_decoder_block_nvfp4_spec
    init_megatron(ep=world_size)
    config = moe_config(world_size, dispatcher)
    torch.manual_seed(0)  # the SR seeds: the same on every rank
    model = gpt(config, get_gpt_decoder_block_nvfp4_spec(config))
    layers = model.decoder.layers
    assert [isinstance(layer.mlp.experts, NVFP4GroupedMLP) for layer in layers[1:]] == [True] * 3
    assert not hasattr(layers[0].mlp, "experts")
    experts = layers[1].mlp.experts
    assert experts.num_local_experts == EXPERTS // world_size
    assert experts.linear_fc1.layer_name == "decoder.layers.1.mlp.experts.linear_fc1"
    assert layers[1].mlp.shared_experts.linear_fc1.layer_name == "decoder.layers.1.mlp.shared_experts.linear_fc1"
    for param in experts.parameters():
        assert param.allreduce is (world_size == 1)
    assert layers[1].mlp.router.weight.dtype == torch.float32 and not hasattr(layers[1].mlp.router, "weight_cache")
    losses = train(model, rank, steps=6)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses
    assert experts.linear_fc1.last_recipe is not None  # the experts ran in NVFP4
    if world_size > 1:  # dense parameters stay equal across ranks, each rank's experts are its own
        gathered = [torch.empty_like(layers[0].mlp.linear_fc1.weight) for _ in range(world_size)]
        dist.all_gather(gathered, layers[0].mlp.linear_fc1.weight.detach().contiguous())
        assert torch.equal(gathered[0], gathered[1])
        gathered = [torch.empty_like(experts.linear_fc1.weight0) for _ in range(world_size)]
        dist.all_gather(gathered, experts.linear_fc1.weight0.detach().contiguous())
        assert not torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_gpt_trains_in_megatron_schedule_ep2(dispatcher):
    run_distributed(_training_worker, 2, dispatcher)


def test_moe_gpt_trains_in_megatron_schedule_ep1():
    run_distributed(_training_worker, 1, "alltoall")


# Final loss of the NVFP4 MoE model against the same model in BF16 after 6 steps at EP=2 (measured on the CPU: 1.8%
# with BF16 dispatch, 2.6% with NVFP4 dispatch).
NVFP4_VS_BF16_FINAL_LOSS = 0.05


def _tracking_worker(rank, world_size):
    """The NVFP4 MoE model, with BF16 and with NVFP4 dispatch, trains as the BF16 model (its BF16 fallback, which is
    Megatron's local MoE model) does, in Megatron's schedule at EP=2."""
    from nvfp4_dist.parallel.megatron import NVFP4MoELayer, get_gpt_decoder_block_nvfp4_spec
    from nvfp4_dist.parallel.megatron import moe as megatron_moe
    finals = {}
    for name, kwargs in (("bf16", dict(bf16_first_layers=4)), ("nvfp4", dict(recipe=nv.NVFP4Recipe())),
                         ("nvfp4_dispatch", dict(recipe=nv.NVFP4Recipe(moe_dispatch="nvfp4")))):
        init_megatron(ep=world_size)
        config = moe_config(world_size)
        torch.manual_seed(0)
        model = gpt(config, get_gpt_decoder_block_nvfp4_spec(config, **kwargs))
        assert isinstance(model.decoder.layers[1].mlp, NVFP4MoELayer)
        dispatched = []
        original = megatron_moe.dispatch_nvfp4

        def counted(*args, **kw):
            dispatched.append(1)
            return original(*args, **kw)
        megatron_moe.dispatch_nvfp4 = counted
        try:
            losses = train(model, rank, steps=6)
        finally:
            megatron_moe.dispatch_nvfp4 = original
        assert bool(dispatched) is (name == "nvfp4_dispatch"), name
        assert losses[-1] < losses[0] - 0.3, (name, losses)
        finals[name] = losses[-1]
    for name in ("nvfp4", "nvfp4_dispatch"):
        assert finals[name] != finals["bf16"]
        assert abs(finals[name] - finals["bf16"]) <= NVFP4_VS_BF16_FINAL_LOSS * finals["bf16"], finals


def test_nvfp4_moe_tracks_bf16_with_both_dispatch_modes_ep2():
    run_distributed(_tracking_worker, 2)


def _bf16_equivalence_worker(rank, world_size):
    """In BF16 fallback the NVFP4 spec's MoE model is Megatron's local MoE model (SequentialMLP experts) at EP=1,
    and the same model at EP=2 (each global expert's weights are drawn in order whatever the EP size)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec, with_sdpa_attention
    data = batches(0, 1)[0]

    def loss_of(model):
        loss = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"]).mean()
        loss.backward()
        return loss.detach()

    init_megatron(ep=1)
    config = moe_config(1)
    local = gpt(config, with_sdpa_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False)))
    ours = gpt(config, get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=4, fused_producers=False))
    theirs = dict(local.named_parameters())
    mapped = {}
    for name, param in ours.named_parameters():
        key = name
        if ".mlp.experts.linear_fc" in name:
            head, tail = name.split(".mlp.experts.")
            linear, kind = tail.split(".")
            index = kind.lstrip("weightbias")
            key = f"{head}.mlp.experts.local_experts.{index}.{linear}.{kind.rstrip('0123456789')}"
        mapped[key] = param
    assert sorted(mapped) == sorted(theirs)
    for name, param in theirs.items():
        assert torch.equal(mapped[name], param), name
    torch.testing.assert_close(loss_of(ours), loss_of(local), rtol=1e-5, atol=1e-5)
    for name, param in theirs.items():
        torch.testing.assert_close(mapped[name].grad, param.grad, rtol=1e-4, atol=1e-5, msg=name)

    # With expert biases (which Megatron's local MLP cannot add on the CPU), EP=2 against EP=1.
    config = moe_config(1, add_bias_linear=True, moe_shared_expert_intermediate_size=None)
    ours = gpt(config, get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=4, fused_producers=False))
    with torch.no_grad():  # expert biases start at zero; give them values that the test can see
        for name, param in ours.named_parameters():
            if ".mlp.experts." in name and ".bias" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    ours_loss = loss_of(ours)
    init_megatron(ep=world_size)
    config = moe_config(world_size, add_bias_linear=True, moe_shared_expert_intermediate_size=None)
    spread = gpt(config, get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=4, fused_producers=False))
    local_experts = EXPERTS // world_size
    whole = dict(ours.named_parameters())
    with torch.no_grad():
        for name, param in spread.named_parameters():
            if ".mlp.experts.linear_fc" in name and ".bias" in name:
                head, index = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")):])
                param.copy_(whole[f"{head}{rank * local_experts + index}"])
    torch.testing.assert_close(loss_of(spread), ours_loss, rtol=1e-5, atol=1e-5)
    for name, param in spread.named_parameters():
        if ".mlp.experts.linear_fc" in name:
            head, index = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")):])
            twin = whole[f"{head}{rank * local_experts + index}"]
            assert torch.equal(param, twin), name
            # Each rank's experts receive the tokens of both ranks (the same data here): twice the EP=1 gradient.
            torch.testing.assert_close(param.grad, world_size * twin.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_fallback_equals_megatron_local_moe_and_ep2():
    run_distributed(_bf16_equivalence_worker, 2)


def _checkpoint_layout_worker(rank, world_size):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec, with_sdpa_attention
    init_megatron(ep=world_size)
    config = moe_config(world_size, add_bias_linear=True, moe_shared_expert_intermediate_size=None)
    local = gpt(config, with_sdpa_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False)))
    ours = gpt(config, get_gpt_decoder_block_nvfp4_spec(config, fused_producers=False))

    def layout(model):
        entries = model.sharded_state_dict()
        return sorted((value.key, value.global_offset if hasattr(value, "global_offset") else None,
                       getattr(value, "global_shape", None), getattr(value, "replica_id", None))
                      for key, value in entries.items() if ".experts." in key and "_extra_state" not in key)
    ours_layout, theirs_layout = layout(ours), layout(local)
    assert ours_layout == theirs_layout
    assert len(ours_layout) == 3 * 4 * (EXPERTS // world_size)  # MoE layers x (fc1, fc2 weights and biases)


def test_checkpoint_layout_is_sequential_mlps_ep2():
    run_distributed(_checkpoint_layout_worker, 2)


def _expert_tensor_parallel_worker(rank, world_size):
    """ETP=2 (the dispatcher gathers and reduce-scatters): in BF16 fallback the same loss and expert gradients as
    ETP=1, the shards being Megatron's (fc1 strided [gate | up], fc2 by columns)."""
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec
    data = batches(0, 1)[0]
    results = {}
    for etp in (1, 2):
        init_megatron(ep=1, etp=etp)
        config = moe_config(1, "alltoall", expert_tensor_parallel_size=etp)
        model = gpt(config, get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=4))
        loss = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"]).mean()
        loss.backward()
        experts = model.decoder.layers[1].mlp.experts
        results[etp] = (loss.detach(), experts.linear_fc1.weight3.detach(), experts.linear_fc1.weight3.grad,
                        experts.linear_fc2.weight3.detach(), experts.linear_fc2.weight3.grad)
        assert experts.linear_fc1.weight3.partition_stride == 2 and experts.linear_fc2.weight3.partition_dim == 1
        assert experts.linear_fc1.weight3.allreduce is (etp == 1)
    torch.testing.assert_close(results[2][0], results[1][0], rtol=1e-5, atol=1e-5)
    half = MOE_FFN // 2
    full_fc1, full_fc1_grad = results[1][1], results[1][2]
    shard = torch.arange(rank * half, (rank + 1) * half)
    rows = torch.cat([shard, MOE_FFN + shard])
    assert torch.equal(results[2][1], full_fc1[rows])
    # The expert-TP group's dispatcher gathers both ranks' tokens (the same data here): twice the ETP=1 gradient.
    torch.testing.assert_close(results[2][2], 2 * full_fc1_grad[rows], rtol=1e-4, atol=1e-6)
    assert torch.equal(results[2][3], results[1][3][:, rank * half:(rank + 1) * half])
    torch.testing.assert_close(results[2][4], 2 * results[1][4][:, rank * half:(rank + 1) * half], rtol=1e-4,
                               atol=1e-6)


def test_expert_tensor_parallel_shards_etp2():
    run_distributed(_expert_tensor_parallel_worker, 2)


def test_moe_layer_pattern_is_validated():
    from nvfp4_dist.parallel.megatron import moe_layer_pattern
    assert moe_layer_pattern(moe_config(1, moe_layer_freq=2)) == [True, False, True, False]
    assert moe_layer_pattern(moe_config(1, moe_layer_freq=[1, 0, 0, 1])) == [True, False, False, True]
    assert moe_layer_pattern(moe_config(1, num_moe_experts=None, moe_shared_expert_intermediate_size=None,
                                        moe_ffn_hidden_size=None)) == \
        [False] * 4
    with pytest.raises(ValueError, match="moe_layer_freq"):
        moe_layer_pattern(moe_config(1, moe_layer_freq=[1, 0]))


def _recipe_map_worker(rank, world_size):
    """A recipe map reaches the experts by their names: experts of layer 1 in BF16, the others NVFP4."""
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec
    init_megatron(ep=1)
    config = moe_config(1, moe_shared_expert_intermediate_size=None)
    spec = get_gpt_decoder_block_nvfp4_spec(config, recipe_map={"decoder.layers.1.mlp.experts.*": "bf16"})
    model = gpt(config, spec)
    data = batches(0, 1)[0]
    model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"]).mean().backward()
    layers = model.decoder.layers
    assert layers[1].mlp.experts.linear_fc1.last_recipe is None
    assert layers[2].mlp.experts.linear_fc1.last_recipe is not None
    assert layers[2].mlp.experts.linear_fc2.layer_name == "decoder.layers.2.mlp.experts.linear_fc2"


def test_recipe_map_names_the_experts():
    run_distributed(_recipe_map_worker, 1)
