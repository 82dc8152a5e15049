"""What CUDA graph support changed that the CPU can check: seeds given as tensors, the checks suspended during
make_graphed_callables' warm-up, and the Megatron specs' default attention. The captures themselves run on GPUs
(tests_multigpu/test_cuda_graphs_gpu.py)."""
import math

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import finite_check, ops


def test_a_seed_tensor_quantizes_as_its_int():
    torch.manual_seed(0)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    recipe = nv.NVFP4Recipe()
    by_int = nv.quantize(x, "gradient", recipe=recipe, sr_seed=123456789)
    by_tensor = nv.quantize(x, "gradient", recipe=recipe, sr_seed=torch.tensor([123456789]))
    other = nv.quantize(x, "gradient", recipe=recipe, sr_seed=987654321)
    for a, b in zip(by_int.tensors(), by_tensor.tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch.equal(by_int.rowwise_data, other.rowwise_data)


@pytest.mark.parametrize("seed", [torch.tensor([1.0]), torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32)])
def test_a_bad_seed_tensor_is_refused(seed):
    with pytest.raises(ValueError, match="sr_seed"):
        nv.quantize(torch.randn(32, 64, dtype=torch.bfloat16), "gradient", sr_seed=seed)


def test_cpu_seeds_come_from_the_cpu_generator():
    torch.manual_seed(5)
    first = ops.draw_sr_seed(torch.zeros(1))
    torch.manual_seed(5)
    assert isinstance(first, int) and first == ops.draw_sr_seed()
    assert 0 <= first < 2 ** 62


def test_suspended_checks_skip_eager_calls_only_inside_the_block():
    def explain(values):
        return None if all(math.isfinite(v) for v in values) else "bad amax"
    with finite_check.suspended_outside_capture():
        finite_check.check(torch.tensor([float("nan")]), explain)
        with finite_check.suspended_outside_capture():
            finite_check.check(torch.tensor([float("inf")]), explain)
        finite_check.check(torch.tensor([float("nan")]), explain)
    with pytest.raises(nv.NonFiniteAmaxError, match="bad amax"):
        finite_check.check(torch.tensor([float("nan")]), explain)
    with pytest.raises(RuntimeError):
        with finite_check.suspended_outside_capture():
            raise RuntimeError("the block's error passes through")
    with pytest.raises(nv.NonFiniteAmaxError):  # and the suspension ended with it
        finite_check.check(torch.tensor([float("nan")]), explain)


def test_megatron_specs_default_to_sdpa_attention():
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install '.[megatron]')")
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from nvfp4_dist.parallel.megatron import SDPACoreAttention, get_gpt_decoder_block_nvfp4_spec, get_gpt_layer_nvfp4_spec

    def core_attention(layer_spec):
        return layer_spec.submodules.self_attention.submodules.core_attention
    assert core_attention(get_gpt_layer_nvfp4_spec()) is SDPACoreAttention
    assert core_attention(get_gpt_layer_nvfp4_spec(sdpa_attention=False)) is DotProductAttention
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    block = get_gpt_decoder_block_nvfp4_spec(config, pp_rank=0)
    assert all(core_attention(layer) is SDPACoreAttention for layer in block.layer_specs)
    config.context_parallel_size = 2  # SDPACoreAttention refuses it: the block keeps Megatron's attention
    block = get_gpt_decoder_block_nvfp4_spec(config, pp_rank=0)
    assert all(core_attention(layer) is DotProductAttention for layer in block.layer_specs)
    explicit = get_gpt_decoder_block_nvfp4_spec(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4),
                                                sdpa_attention=False, pp_rank=0)
    assert all(core_attention(layer) is DotProductAttention for layer in explicit.layer_specs)


def test_captures_default_to_thread_local_mode_inside_make_graphed_callables(monkeypatch):
    """Inside nv.make_graphed_callables a torch.cuda.graph built without a capture_error_mode takes "thread_local"
    (one given explicitly is kept), and torch's default comes back afterwards, also after an error."""
    from nvfp4_dist import graphs
    seen = []
    monkeypatch.setattr(torch.cuda.graph, "__init__", lambda self, *args, **kwargs: seen.append(kwargs))
    original = torch.cuda.graph.__init__
    with graphs._thread_local_capture_mode():
        torch.cuda.graph.__init__(object(), None)
        torch.cuda.graph.__init__(object(), None, capture_error_mode="relaxed")
    assert seen == [{"capture_error_mode": "thread_local"}, {"capture_error_mode": "relaxed"}]
    assert torch.cuda.graph.__init__ is original
    with pytest.raises(RuntimeError), graphs._thread_local_capture_mode():
        raise RuntimeError("capture failed")
    assert torch.cuda.graph.__init__ is original
