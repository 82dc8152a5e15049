"""Batch split: a Megatron decoder block run as parts of each micro-batch at once, to hide communication.

Inside one transformer layer every collective waits for the work before it (the norm, attention, the SwiGLU),
so over slow links the communication lane idles while those run and the GEMMs wait while it works
(docs/slow_links.md). Parts of a micro-batch (split along the batch dim b of [s, b, h]) have no such dependencies
on each other: split_batch(model, parts) makes the decoder block run its first part on the current CUDA stream
over the layers' tensor-parallel group and each other part on a stream of its own over a twin group (the same
ranks in the same order, its own NCCL communicator and stream), so that one part computes while another
communicates. The parts join after the block (the final norm included); backward runs on the same streams.

Numerics: each part is quantized on its own (per-tensor amaxes of its tokens), so the outputs equal the unsplit
block run on each part separately, not on the whole micro-batch at once (as smaller micro-batches would give).
A micro-batch of fewer samples than parts is split into single samples; calls with packed sequences,
cross-attention context, inference state or intermediate outputs run whole. Refused: a block with Megatron's own
linears (their group cannot be switched), MoE, activation recomputation, CUDA graphs and delayed wgrad.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.transformer.transformer_block import TransformerBlock

from nvfp4_dist.parallel.layers import _ParallelLinear
from nvfp4_dist.parallel.link_speed import known_link_speed, set_link_speed

_twins: dict = {}
_streams: dict = {}
_BATCH_FIRST = ("attention_mask", "attention_bias", "padding_mask")  # tensor arguments with b as their dim 0
_WHOLE_ONLY = ("context", "context_mask", "inference_context", "inference_params", "packed_seq_params",
               "sequence_len_offset", "extract_layer_indices")  # set: the call runs whole


def twin_groups(group, count: int) -> list:
    """`count` more process groups of `group`'s ranks in the same order, made once per group and kept. Collective
    over the world: every rank calls it, in the same order (it makes the twins of every group of that kind)."""
    made = _twins.setdefault(group, [])
    if len(made) < count:
        ranks = dist.get_process_group_ranks(group)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, ranks)
        for _ in range(count - len(made)):
            for members in sorted({tuple(r) for r in every}):
                twin = dist.new_group(list(members))
                if list(members) == ranks:
                    made.append(twin)
    return made[:count]


def _given(value) -> bool:
    """Whether an optional argument is set (not None, False or empty)."""
    if isinstance(value, (set, list, tuple, dict)):
        return len(value) > 0
    return value is not None and value is not False


def _part_stream(device: torch.device, index: int) -> torch.cuda.Stream:
    """The stream of part `index` (1, 2, ...) on `device`, made once."""
    if (device, index) not in _streams:
        _streams[device, index] = torch.cuda.Stream(device)
    return _streams[device, index]


class BatchSplitTransformerBlock(TransformerBlock):
    """TransformerBlock whose forward runs parts of the micro-batch at once (module docstring); made by
    split_batch()."""

    _linears: list
    _groups: list = []  # the layers' tensor-parallel group, then one twin per further part

    def forward(self, *args, **kwargs):
        named = inspect.signature(TransformerBlock.forward).bind(self, *args, **kwargs).arguments
        named.pop("self")
        named.update(named.pop("kwargs", {}))  # a **kwargs catch-all, where the Megatron version has one
        source = named.get("hidden_states") if self.pre_process else self.input_tensor
        parts = self._parts(source, named)
        if parts is None:
            return super().forward(*args, **kwargs)
        device = source.device
        if device.type != "cuda":
            return torch.cat([self._run_part(part, named, group) for part, group in zip(parts, self._groups)], dim=1)
        for linear in self._linears:  # quantized on this stream, before the other streams may read the copies
            linear.prepare_weight()
        main = torch.cuda.current_stream(device)
        ready = torch.cuda.Event()
        ready.record(main)
        outputs = [self._run_part(parts[0], named, self._groups[0])]
        for group in self._groups[1:]:  # the first part measured the links: the twins share its measurement
            if known_link_speed(group) is None and known_link_speed(self._groups[0]) is not None:
                set_link_speed(group, known_link_speed(self._groups[0]))
        for index, (part, group) in enumerate(zip(parts[1:], self._groups[1:]), start=1):
            stream = _part_stream(device, index)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                outputs.append(self._run_part(part, named, group))
            main.wait_stream(stream)
            outputs[-1].record_stream(main)
        return torch.cat(outputs, dim=1)

    def _parts(self, source, named: dict):
        """[(hidden states, {argument: value}) per part], or None where the call runs whole."""
        if (not isinstance(source, torch.Tensor) or source.dim() != 3 or source.shape[1] < 2
                or any(_given(named.get(name)) for name in _WHOLE_ONLY)):
            return None
        batch = source.shape[1]
        count = min(len(self._groups), batch)
        sizes = [batch // count + (1 if index < batch % count else 0) for index in range(count)]
        arguments = [{} for _ in sizes]
        for name in _BATCH_FIRST:
            value = named.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != 1:
                if value.shape[0] != batch:
                    return None
                for part_arguments, part in zip(arguments, value.split(sizes, dim=0)):
                    part_arguments[name] = part
        return list(zip(source.split(sizes, dim=1), arguments))

    def _run_part(self, part, named: dict, group) -> torch.Tensor:
        hidden, arguments = part
        call = dict(named, **arguments)
        hidden = hidden.contiguous()
        saved_input = getattr(self, "input_tensor", None)
        if self.pre_process:
            call["hidden_states"] = hidden
        else:  # a later pipeline stage: Megatron's block reads self.input_tensor
            self.input_tensor = hidden
        try:
            with contextlib.ExitStack() as stack:
                for linear in self._linears:
                    stack.enter_context(linear.communicating_over(group))
                return super().forward(**call)
        finally:
            if not self.pre_process:
                self.input_tensor = saved_input


def split_batch(model, parts: int = 2) -> TransformerBlock:
    """Make `model`'s decoder block (a GPTModel, the TransformerBlock itself, or a wrapper of either with a `.module`
    such as Megatron's DDP and Float16Module) run each micro-batch as `parts` parts at once (module docstring);
    returns the block. Call on every rank after building the model: it makes the twin tensor-parallel groups
    (collective). parts=1 restores the whole-batch block."""
    block = model
    while not isinstance(block, TransformerBlock) and not hasattr(block, "decoder") and hasattr(block, "module"):
        block = block.module
    block = getattr(block, "decoder", block)
    if type(block) not in (TransformerBlock, BatchSplitTransformerBlock):
        raise ValueError(f"split_batch: {type(block).__name__} is not Megatron's TransformerBlock")
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"split_batch: parts={parts!r} must be an integer >= 1")
    config = block.config
    problems = [f"{name}={getattr(config, name)!r}" for name in ("num_moe_experts", "recompute_granularity",
                                                                   "delay_wgrad_compute")
                if getattr(config, name, None)]
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "cuda_graph_impl", "none") not in ("none", None):
        problems.append("CUDA graphs")
    megatron_linears = [name for name, module in block.named_modules()
                        if isinstance(module, (megatron_layers.ColumnParallelLinear, megatron_layers.RowParallelLinear))]
    if megatron_linears:
        problems.append(f"Megatron's own linears ({megatron_linears[0]}, ...): use the NVFP4 spec "
                        "(get_gpt_decoder_block_nvfp4_spec; its BF16 layers split too)")
    linears = [module for module in block.modules() if isinstance(module, _ParallelLinear)]
    groups = {id(linear.tp_group): linear.tp_group for linear in linears}
    if len(groups) > 1:
        problems.append(f"linears over {len(groups)} different tensor-parallel groups")
    if problems:
        raise ValueError("split_batch: not supported with " + "; ".join(problems))
    if parts == 1 or not linears or linears[0].world_size == 1:  # whole (TP=1: no communication to hide)
        block.__class__ = TransformerBlock
        return block
    block.__class__ = BatchSplitTransformerBlock
    block._linears = linears
    block._groups = [linears[0].tp_group, *twin_groups(linears[0].tp_group, parts - 1)]
    return block
