"""Batch split: a Megatron decoder block run as two halves of each micro-batch at once, to hide communication.

Inside one transformer layer every collective waits for the work before it (the norm, attention, the SwiGLU),
so over slow links the communication lane idles while those run and the GEMMs wait while it works
(docs/slow_links.md). The two halves of a micro-batch (split along the batch dim b of [s, b, h]) have no such
dependencies on each other: split_batch(model) makes the decoder block run the first half on the current CUDA
stream over the layers' tensor-parallel group and the second half on a second stream over a twin group (the
same ranks in the same order, its own NCCL communicator and stream), so that one half computes while the other
communicates. The halves join after the block (the final norm included); backward runs on the same two streams.

Numerics: each half is quantized on its own (per-tensor amaxes of half the tokens), so the outputs equal the
unsplit block run on each half separately, not on the whole micro-batch at once (which is what a micro-batch half
the size gives).
Micro-batches of one sample, and calls with packed sequences, cross-attention context, inference state or
intermediate outputs, run whole. Refused: a block with Megatron's own linears (their group cannot be switched),
MoE, activation recomputation, CUDA graphs and delayed wgrad.
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


def twin_group(group):
    """A second process group of `group`'s ranks in the same order, made once per group. Collective over the
    world: every rank calls it, in the same order (it makes the twin of every group of that kind at once)."""
    if group not in _twins:
        ranks = dist.get_process_group_ranks(group)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, ranks)
        for members in sorted({tuple(r) for r in every}):
            made = dist.new_group(list(members))
            if list(members) == ranks:
                _twins[group] = made
    return _twins[group]


def _given(value) -> bool:
    """Whether an optional argument is set (not None, False or empty)."""
    if isinstance(value, (set, list, tuple, dict)):
        return len(value) > 0
    return value is not None and value is not False


def _recorded_event(stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _second_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class BatchSplitTransformerBlock(TransformerBlock):
    """TransformerBlock whose forward runs the two halves of the micro-batch at once (module docstring); made by
    split_batch()."""

    _linears: list
    _group = None
    _twin = None
    # Where in the first layer of the first half the second half starts: "block" (at once), "attention" (the core
    # attention) or "mlp". A start part-way in staggers the halves, so one half's collectives meet the other's
    # GEMMs instead of its own.
    second_half_start = "mlp"

    def forward(self, *args, **kwargs):
        named = inspect.signature(TransformerBlock.forward).bind(self, *args, **kwargs).arguments
        named.pop("self")
        extra = named.pop("kwargs", {})  # a **kwargs catch-all, where the Megatron version has one
        named.update(extra)
        source = named.get("hidden_states") if self.pre_process else self.input_tensor
        halves = self._halves(source, named)
        if halves is None:
            return super().forward(*args, **kwargs)
        device = source.device
        if device.type == "cuda":
            for linear in self._linears:  # on this stream, before the second stream may read the copies
                linear.prepare_weight()
            main = torch.cuda.current_stream(device)
            second = _second_stream(device)
            hook, started = self._mark_second_half_start()
        outputs = [self._run_half(halves[0], named)]
        if known_link_speed(self._twin) is None and known_link_speed(self._group) is not None:
            set_link_speed(self._twin, known_link_speed(self._group))  # the first half measured the links
        if device.type == "cuda":
            if hook is not None:
                hook.remove()
            second.wait_event(started[0] if started else _recorded_event(main))
            with torch.cuda.stream(second):
                outputs.append(self._run_half(halves[1], named, self._twin))
            main.wait_stream(second)
            outputs[1].record_stream(main)
        else:
            outputs.append(self._run_half(halves[1], named, self._twin))
        return torch.cat(outputs, dim=1)

    def _mark_second_half_start(self) -> tuple:
        """(a forward pre-hook to remove after the first half, or None; a list that gets the event on the first
        half's stream at which the second half starts, at second_half_start of the first layer)."""
        started: list = []
        if self.second_half_start == "block" or not len(self.layers):
            started.append(_recorded_event(torch.cuda.current_stream()))
            return None, started
        layer = self.layers[0]
        module = layer.mlp if self.second_half_start == "mlp" else layer.self_attention.core_attention

        def record(*_):
            if not started:
                started.append(_recorded_event(torch.cuda.current_stream()))

        return module.register_forward_pre_hook(record), started

    def _halves(self, source, named: dict):
        """[(hidden states, {argument: value}) per half], or None where the call runs whole."""
        if (not isinstance(source, torch.Tensor) or source.dim() != 3 or source.shape[1] < 2
                or any(_given(named.get(name)) for name in _WHOLE_ONLY)):
            return None
        batch = source.shape[1]
        sizes = [batch // 2, batch - batch // 2]
        arguments = [{}, {}]
        for name in _BATCH_FIRST:
            value = named.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != 1:
                if value.shape[0] != batch:
                    return None
                for half, part in zip(arguments, value.split(sizes, dim=0)):
                    half[name] = part
        return [(part, half) for part, half in zip(source.split(sizes, dim=1), arguments)]

    def _run_half(self, half, named: dict, group=None) -> torch.Tensor:
        hidden, arguments = half
        call = dict(named, **arguments)
        hidden = hidden.contiguous()
        saved_input = getattr(self, "input_tensor", None)
        if self.pre_process:
            call["hidden_states"] = hidden
        else:  # a later pipeline stage: Megatron's block reads self.input_tensor
            self.input_tensor = hidden
        try:
            with contextlib.ExitStack() as stack:
                for linear in self._linears if group is not None else ():
                    stack.enter_context(linear.communicating_over(group))
                return super().forward(**call)
        finally:
            if not self.pre_process:
                self.input_tensor = saved_input


def split_batch(model) -> TransformerBlock:
    """Make `model`'s decoder block (a GPTModel, or the TransformerBlock itself) run each micro-batch as two
    halves at once (module docstring); returns the block. Call on every rank after building the model: it makes
    the twin tensor-parallel groups (collective)."""
    block = getattr(model, "decoder", model)
    if type(block) not in (TransformerBlock, BatchSplitTransformerBlock):
        raise ValueError(f"split_batch: {type(block).__name__} is not Megatron's TransformerBlock")
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
    block.__class__ = BatchSplitTransformerBlock
    block._linears = linears
    if linears and linears[0].world_size > 1:
        block._group = linears[0].tp_group
        block._twin = twin_group(block._group)
    else:  # nothing to hide: run whole
        block.__class__ = TransformerBlock
    return block
