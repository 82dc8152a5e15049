"""Megatron-Core on CPU processes (gloo): where megatron-core assumes CUDA, mapped to the CPU. CpuForCuda and
init_megatron for its DistributedDataParallel and optimizer (benchmarks/param_gather.py --megatron,
tests/test_megatron_param_gather.py); megatron_moe_on_cpu for its MoE layer and schedules (benchmarks/moe_convergence.py,
tests/test_moe_megatron.py)."""
from __future__ import annotations

import contextlib

import torch


class CpuForCuda(torch.overrides.TorchFunctionMode):
    """Megatron's optimizers allocate their scalars on device='cuda' and accept only parameters whose type() names a
    CUDA tensor: on a CPU process both are mapped to the CPU (use it around the optimizer's calls only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def init_megatron(tp: int = 1) -> None:
    """Megatron's groups on the gloo world; its helpers' CUDA device made the CPU (as tests/test_megatron.py does)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    torch.cuda.current_device = lambda: torch.device("cpu")
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


class _HostStream:
    """What Megatron's alltoall dispatcher asks of its device-to-host CUDA stream, on the CPU."""

    def wait_stream(self, *args):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


class _HostTorch:
    """torch for Megatron's schedules, whose token counter is allocated on "cuda": allocated on the host instead."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


def megatron_moe_on_cpu() -> None:
    """Let Megatron's MoE layer and schedules run on this CPU-only process: its CUDA device, RNG tracker and side
    stream become the CPU and no-ops, its split sizes go to the host as numpy arrays as they do from a GPU, its
    router's optional Transformer Engine GEMM (an unbound name without Transformer Engine in megatron-core 0.16) is
    absent, and the schedules' token counter lives on the host."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda *args: _HostStream()
    torch.cuda.stream = lambda *args: contextlib.nullcontext()
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HostStream()
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def splits_to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)
    token_dispatcher.maybe_move_tensor_to_cpu = splits_to_host
    schedules.torch = _HostTorch()
