"""Megatron-Core's distributed checkpointing (megatron.core.dist_checkpointing, torch_dist backend) on CPU-only gloo
processes, for the CPU tests (tests/test_megatron_dist_checkpoint.py).

What megatron-core 0.16.1 needs on a CPU-only process without Apex / Transformer Engine, each patched here narrowly,
in the calling (forked) test process only, never in product code:

- `FileSystemWriterAsync.preload_tensors` (strategies/filesystem_async.py:230) calls `torch.cuda.synchronize()`
  after its device-to-host copies: made a no-op (there is no device).
- The forked writer process (`write_preloaded_data`) first measures its memory with psutil (filesystem_async.py:366,
  before its try block), and `_process_memory` raises when psutil is not installed (line 642; megatron-core does
  not require psutil). The writer dies without `count_queue.task_done()` (line 412) and the saving rank waits for
  ever in `count_queue.join()` (line 308): the hang seen with `dp_reshardable` (any save hangs so). Without psutil
  the measure reads 0 here (it is only logged).
- The distributed optimizer with torch's own Adam (HAVE_APEX_OR_TE is False) keeps `step` in each parameter's
  state. Its `state_dict()` (distrib_optimizer.py:642) asserts that a state exists, so a fresh optimizer cannot
  give the sharded state dict to load into: `allocate_torch_adam_state` allocates it (Megatron's own
  `init_state_fn`, plus a step), as a fused Adam has it from construction. And the `dp_reshardable` format maps
  `step` to a LocalNonpersistentObject (distrib_optimizer.py:1667), i.e. the fresh optimizer's own step tensor,
  which `_set_main_param_and_optimizer_states` (distrib_optimizer.py:940) then copies over the step that
  `load_state_dict` had just restored from the checkpoint's param groups (line 825): the load resets Adam's step,
  so the next update differs. `fully_reshardable` raises KeyError 'step' at the same line. Moreover
  `load_state_dict` puts one and the same step tensor in every parameter's state (line 825; torch's
  Optimizer.load_state_dict does not copy `step`), and torch's Adam increments each parameter's step in place: after
  one update the shared step has advanced once per parameter. Here that copy skips `step` (the step comes from the
  param groups, as the `fully_sharded_model_space` loader does, line 1820) and gives each parameter its own step.

- With the fully-parallel strategies (`FullyParallelSaveStrategyWrapper` / `FullyParallelLoadStrategyWrapper`, what
  Megatron's training loop uses with --ckpt-fully-parallel-save / -load), the load exchanges the loaded shards
  in tensors it allocates with device="cuda" and `.cuda()` (dist_checkpointing/exchange_utils.py:98-110, 326-336,
  499): `load(..., fully_parallel=True)` runs it with those allocations on the CPU (`_CudaAllocationsOnCpu`).

Megatron's default optimizer format, `fully_sharded_model_space`, cannot be saved with 0.16.1 on any device: it
builds ShardedTensors with `flattened_range` (distrib_optimizer.py:1748), which mapping.py:134 refuses
("ShardedTensor.flattened_range is not supported").
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["dist_checkpointing_on_cpu", "save", "load", "allocate_torch_adam_state"]

_PATCHED = False


def dist_checkpointing_on_cpu() -> None:
    """Apply the patches above in this process (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    torch.cuda.synchronize = lambda *args, **kwargs: None
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_but_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return set_states(self, model_param, {key: value for key, value in tensors.items() if key != "step"})
        finally:
            if step is not None:
                state["step"] = step.clone()  # its own: load_state_dict gave every parameter the same tensor
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_but_step
    _PATCHED = True


def allocate_torch_adam_state(optimizer) -> None:
    """Allocate the inner torch Adam's state of a fresh Megatron optimizer (each of a ChainedOptimizer's), so that
    its sharded_state_dict(is_loading=True) can be built; the load overwrites all of it."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.init_state_fn(opt.optimizer, opt.config)
        for state in opt.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


class _CudaAllocationsOnCpu(TorchFunctionMode):
    """Allocations on device="cuda" and `.cuda()` copies made on / left on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _parallelization_group():
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def save(sharded_state_dict, directory, *, fully_parallel: bool = False) -> None:
    """dist_checkpointing.save with the torch_dist backend chosen explicitly; fully_parallel: wrapped in
    FullyParallelSaveStrategyWrapper over the data-parallel group (the ranks split the replicated entries' writes)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    strategy = get_default_save_sharded_strategy("torch_dist")
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, _parallelization_group())
    dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=strategy)


def load(sharded_state_dict, directory, *, fully_parallel: bool = False):
    """dist_checkpointing.load; fully_parallel: wrapped in FullyParallelLoadStrategyWrapper over the data-parallel
    group (each rank reads a part, the ranks exchange the rest)."""
    from megatron.core import dist_checkpointing
    if not fully_parallel:
        return dist_checkpointing.load(sharded_state_dict, str(directory))
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(directory)),
                                                _parallelization_group())
    with _CudaAllocationsOnCpu():
        return dist_checkpointing.load(sharded_state_dict, str(directory), sharded_strategy=strategy)
