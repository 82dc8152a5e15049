"""What every rank of a tensor-parallel group must agree on, checked so that a disagreement stops every rank.

A rank that raised alone would leave the others waiting in the layer's next collective (until the process
group times out), or, where shapes differ, abort inside it. So each check is itself a collective of a fixed
size, which cannot mismatch, after which every rank raises the same way:

- check_finite_across_group: recipe.check_finite of a layer's operands. Each rank's amax maxima travel in
  one small MAX all-reduce (parallel/collectives.py: NaN sent as +inf, so no transport drops it); a NaN/Inf
  on any rank raises NonFiniteAmaxError on every rank (on CUDA at a later check, like every CUDA check:
  nvfp4_dist/finite_check.py), naming the operand, the layer and whether this rank's shard is at fault.
- check_consistency: a layer's configuration, recipe and this call's input (layer_fields: the options, the
  parameters' presence, dtypes and requires_grad, the grad mode, the input's shape, dtype and requires_grad) as
  fixed-size int64 records, all-gathered; a difference raises TensorParallelMismatchError on every rank naming
  the layer, the field and each rank's value. Only plain integers travel (no pickled objects).
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from nvfp4_dist import finite_check
from nvfp4_dist.linear import describe_layer
from nvfp4_dist.parallel import collectives
from nvfp4_dist.recipe import NVFP4Recipe

GROUP = "tensor-parallel rank"
RECORD_SLOTS = 256          # int64 entries of one consistency record (fields beyond this are a program error)
SHAPE_DIMS = 8              # dims of a shape field; longer shapes fold their tail into the last slot
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.uint8,
          torch.int32, torch.int64)
_NO_DTYPE = -1


class TensorParallelMismatchError(ValueError):
    """The ranks of a tensor-parallel group disagree on a layer's configuration, recipe or input."""


def check_finite_across_group(operands: dict, group, *, reduced: frozenset = frozenset()) -> None:
    """Raise NonFiniteAmaxError on every rank when any rank's operand has a NaN/Inf amax.

    operands: {label: NVFP4Tensor or None} of this rank; reduced: labels whose amaxes were already reduced over
    the group before quantizing (equal on every rank, their own values unknown).
    """
    if collectives.group_size(group) == 1:  # nothing to exchange: the check of one process
        finite_check.check_operands(operands)
        return
    present = {label: q for label, q in operands.items() if finite_check.has_amax(q)}
    if not present:
        return
    specs = [finite_check.spec(label, q) for label, q in present.items()]
    own = [label not in reduced for label in present]
    local = torch.cat([finite_check.operand_values(q) for q in present.values()])
    agreed = local.clone()
    if any(own):
        collectives.all_reduce_amax([agreed], group)
    count = local.numel()

    def explain(host):
        mine = [value if own[index // 2] else None for index, value in enumerate(host[count:])]
        return finite_check.explain_operands(specs, host[:count], mine, GROUP)
    finite_check.check(torch.cat([agreed, local]), explain, key=("group", tuple(specs), tuple(own)))


def _text_code(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _encode(kind: str, value) -> list:
    """The int64 slots of one field: kind "int" (one), "dtype" (one), "shape" (SHAPE_DIMS + 1) or "text" (one)."""
    if kind == "int":
        return [int(value)]
    if kind == "dtype":
        return [DTYPES.index(value) if value in DTYPES else _NO_DTYPE]
    if kind == "shape":
        dims = list(value)
        head = dims[:SHAPE_DIMS - 1] + ([_text_code(repr(dims[SHAPE_DIMS - 1:]))] if len(dims) >= SHAPE_DIMS else [])
        return [len(dims)] + head + [-1] * (SHAPE_DIMS - len(head))
    if kind == "text":
        return [_text_code(repr(value))]
    raise ValueError(f"kind={kind!r}: not one of int, dtype, shape, text")


def _decode(kind: str, slots: list, own_slots: list, own_value) -> str:
    """One rank's value of a field, from its slots (a text field shows this rank's own value, or that it differs)."""
    if kind == "int":
        return str(slots[0])
    if kind == "dtype":
        return str(DTYPES[slots[0]]) if 0 <= slots[0] < len(DTYPES) else "none"
    if kind == "shape":
        ndim = slots[0]
        return str(tuple(slots[1:1 + ndim])) if ndim < SHAPE_DIMS else f"a shape of {ndim} dims"
    return repr(own_value) if slots == own_slots else "a different value"


def recipe_fields(recipe) -> list:
    """(name, kind, value) of every recipe field: bools and ints as ints, anything else as text."""
    fields = []
    for field in dataclasses.fields(recipe):
        value = getattr(recipe, field.name)
        kind = "int" if isinstance(value, int) and -2 ** 63 <= value < 2 ** 63 else "text"
        fields.append((f"recipe.{field.name}", kind, value))
    return fields


def parameter_fields(name: str, parameter) -> list:
    """Whether a parameter exists, its dtype and whether it takes a gradient (backward communicates for it)."""
    present = parameter is not None
    return [(name, "int", present), (f"{name} dtype", "dtype", parameter.dtype if present else None),
            (f"{name}.requires_grad", "int", present and parameter.requires_grad)]


def layer_fields(layer, x, recipe) -> list:
    """(name, kind, value) of everything the ranks of a parallel layer's group must agree on for a forward of x with
    `recipe` (None: the BF16 path): what decides which collectives run, in forward and in backward, and their
    shapes and dtypes, and what makes the replicated results equal. layer: a parallel/layers.py layer, whose
    _options() adds its class's own options."""
    is_tensor = isinstance(x, torch.Tensor)
    fields = [("layer", "text", describe_layer(layer)), ("tensor-parallel size", "int", layer.world_size),
              ("in_features", "int", layer.in_features), ("out_features", "int", layer.out_features),
              ("local weight shape", "shape", tuple(layer.weight.shape)),
              ("weight dtype", "dtype", layer.weight.dtype),
              ("weight.requires_grad", "int", layer.weight.requires_grad),
              *parameter_fields("bias", layer.bias),
              ("sequence_parallel", "int", layer.sequence_parallel), ("skip_bias_add", "int", layer.skip_bias_add),
              ("accumulate_into_main_grad", "int", layer.accumulate_into_main_grad),
              ("delay_wgrad", "int", layer.delay_wgrad),
              *layer._options(),
              ("NVFP4 (not bf16_fallback, autocast(enabled=False) or a \"bf16\" recipe map entry)", "int",
               recipe is not None),
              ("grad enabled", "int", torch.is_grad_enabled()),
              ("input shape", "shape", tuple(x.shape) if is_tensor else ()),
              ("input dtype", "dtype", x.dtype if is_tensor else None),
              ("input.requires_grad", "int", is_tensor and x.requires_grad)]
    return fields + recipe_fields(recipe if recipe is not None else NVFP4Recipe())


def _exchange_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_consistency(layer_name: str, fields: list, group, local_error: str | None = None) -> None:
    """Raise on every rank when the ranks' (name, kind, value) fields differ, or when a rank's input was rejected.

    fields: the same names and kinds on every rank (kinds: see _encode). local_error: why this rank rejected its
    input (this rank then raises ValueError with it; the others a TensorParallelMismatchError naming the rank).
    """
    fields = [("input accepted", "int", local_error is None)] + list(fields)
    encoded = [_encode(kind, value) for _, kind, value in fields]
    record = [len(fields)] + [slot for slots in encoded for slot in slots]
    if len(record) > RECORD_SLOTS:
        raise RuntimeError(f"{layer_name}: {len(record)} consistency slots exceed RECORD_SLOTS={RECORD_SLOTS}")
    rank = collectives.group_rank(group)
    local = torch.tensor(record + [0] * (RECORD_SLOTS - len(record)), dtype=torch.int64, device=_exchange_device(group))
    records = collectives.all_gather_stacked(local, group).tolist()
    if any(r[0] != len(fields) for r in records):
        raise TensorParallelMismatchError(f"{layer_name}: the tensor-parallel ranks describe this layer with different "
                                          f"numbers of fields ({[r[0] for r in records]}): different code versions?")
    rejected = [r for r, record_r in enumerate(records) if record_r[1] == 0]
    if local_error is not None:
        raise ValueError(f"{local_error} (tensor-parallel rank {rank} of {layer_name})")
    if rejected:
        raise TensorParallelMismatchError(f"{layer_name}: tensor-parallel rank(s) {rejected} rejected their input "
                                          f"(see their error); this rank stops too")
    differences, offset = [], 1
    for (name, kind, value), slots in zip(fields, encoded):
        per_rank = [record_r[offset:offset + len(slots)] for record_r in records]
        if any(p != per_rank[0] for p in per_rank):
            values = ", ".join(f"rank {r}: {_decode(kind, p, slots, value)}" for r, p in enumerate(per_rank))
            differences.append(f"{name} ({values})")
        offset += len(slots)
    if differences:
        raise TensorParallelMismatchError(f"{layer_name}: the tensor-parallel ranks disagree on "
                                          f"{'; '.join(differences)}")
