"""Megatron-Core's distributed optimizer gathering the NVFP4 linears' weights in NVFP4 (docs/data_parallel.md).

With `DistributedDataParallelConfig(use_distributed_optimizer=True)`, Megatron keeps each model chunk's parameters in
flat param buffers split into buckets; data-parallel rank r owns the elements [r * S, (r + 1) * S) of each bucket
(S = bucket size / W), writes its updated main weights there after the optimizer step, and all-gathers the buckets
(`_ParamAndGradBucketGroup.start_param_sync` / `finish_param_sync`, overlapped with the next forward when
`overlap_param_gather`). enable_nvfp4_param_gather(model_chunks) replaces those two methods, on the bucket groups
that hold NVFP4 linears' weights, by a gather that moves those weights in NVFP4:

- each NVFP4 weight [N, K] is cut into bands of 16 rows (16 * K contiguous elements in the bucket). A band that lies
  inside one rank's element range is that rank's: it quantizes its bands with the whole weight's amax (the local
  amaxes of every weight in the bucket group all-reduced once, MAX) and sends their NVFP4 bytes (codes and one E4M3
  scale per 16x16 block; nvfp4_dist/sharded_weight.py's wire pieces). Everything else in its range (other
  parameters, padding, and the at most W - 1 bands per bucket that straddle two ranges) travels in the parameter
  dtype, as Megatron sends it;
- one all-gather per bucket group moves every rank's bytes (padded to the largest rank's); each rank writes the
  gathered parameter-dtype values into the bucket, quantizes the straddling bands itself from them (every rank gets
  the same bytes), and puts each weight's NVFP4Tensor together from its bands: byte for byte
  `nvfp4_dist.quantize(weight, role="weight")`. The layer takes it instead of quantizing its weight
  (`GatheredNVFP4WeightCache`);
- the BF16 values of the NVFP4 weights' bands that travelled in NVFP4 are not gathered: on other ranks those rows
  of the parameter stay as they were. A forced sync (`start_param_sync(force_sync=True)`: Megatron's
  `disable_forward_pre_hook`, called before checkpoint saves and evaluation) or `NVFP4ParamGather.sync_bf16_weights()`
  runs Megatron's own gather, after which the parameters are whole again; `state_dict()` of a layer whose parameter
  is not whole raises instead of returning those rows.

The recipe a weight is gathered with is the one its layer's last forward ran with (`last_recipe`); a layer whose
last forward ran unquantized or with backward_mode "high_precision" (which reads the unquantized weight) has its
weight gathered in the parameter dtype. If a forward resolves a recipe that the gathered copy does not serve, the
bucket group's parameters are gathered in the parameter dtype first (Megatron's gather) and the layer quantizes its
weight as without this module.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from nvfp4_dist import finite_check, sharded_weight
from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.linear import WeightCache, needs_columnwise_weight
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel.fsdp import _weight_quantization
from nvfp4_dist.parallel.megatron.adapters import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear

logger = logging.getLogger("nvfp4_dist")


def _gathers_nvfp4(recipe: Optional[NVFP4Recipe]) -> bool:
    """Whether a layer whose forward ran `recipe` (None: unquantized) can take its weight gathered in NVFP4."""
    return recipe is not None and recipe.backward_mode != "high_precision"


class GatheredNVFP4WeightCache(WeightCache):
    """A layer's WeightCache that hands out the NVFP4Tensor installed by the NVFP4 param gather; with none installed
    (before the first gather, after a gather in the parameter dtype) it quantizes the weight as WeightCache does."""

    def invalidate(self) -> None:
        super().invalidate()
        self.gathered: Optional[NVFP4Tensor] = None
        self.gathered_recipe: Optional[NVFP4Recipe] = None

    def install(self, q: NVFP4Tensor, recipe: NVFP4Recipe) -> None:
        self.invalidate()
        self.gathered, self.gathered_recipe = q, recipe

    def serves(self, recipe: Optional[NVFP4Recipe]) -> bool:
        """Whether the installed copy is what a forward with `recipe` quantizes the weight to."""
        return (self.gathered is not None and _gathers_nvfp4(recipe)
                and _weight_quantization(recipe) == _weight_quantization(self.gathered_recipe)
                and (not needs_columnwise_weight(recipe) or self.gathered.has_columnwise))

    def get(self, weight: torch.Tensor, recipe: NVFP4Recipe, *, columnwise: bool = True) -> NVFP4Tensor:
        if self.gathered is None:
            return super().get(weight, recipe, columnwise=columnwise)
        if not self.serves(recipe) or (columnwise and not self.gathered.has_columnwise):
            raise ValueError(f"recipe: the weight was gathered in NVFP4 with "
                             f"{_weight_quantization(self.gathered_recipe)} (columnwise copy: "
                             f"{self.gathered.has_columnwise}) but the layer now runs {_weight_quantization(recipe)}")
        return self.gathered


@dataclasses.dataclass
class _Weight:
    """An NVFP4 linear's weight in a bucket: its elements are bucket.param_data[offset : offset + rows * cols]."""
    name: str
    module: torch.nn.Module
    param: torch.nn.Parameter
    offset: int
    rows: int
    cols: int

    @property
    def band(self) -> int:
        return BLOCK_SIZE * self.cols  # elements in 16 rows

    def values(self, bucket) -> torch.Tensor:
        return bucket.param_data[self.offset:self.offset + self.rows * self.cols].view(self.rows, self.cols)


def _piece_shapes(rows: int, cols: int, recipe: NVFP4Recipe, columnwise: bool) -> list:
    """(name, shape) of the wire pieces (sharded_weight.wire_pieces, in its order) of `rows` rows quantized with
    sharded_weight.quantize_shard(..., columnwise=columnwise)."""
    shapes = [("rowwise_data", (rows, cols // 2))]
    if recipe.weight_2d:
        shapes.append(("block_scale", (rows // BLOCK_SIZE, cols // BLOCK_SIZE)))
    else:
        shapes.append(("rowwise_scale", (rows, cols // BLOCK_SIZE)))
    if columnwise and not sharded_weight.derives_columnwise(recipe):
        shapes += [("columnwise_data", (cols, rows // 2)), ("columnwise_scale", (cols, rows // BLOCK_SIZE))]
    return shapes


def _subtract(start: int, end: int, holes: list) -> list:
    """[start, end) minus the sorted, disjoint intervals `holes` (each inside it), as intervals."""
    out, cursor = [], start
    for hole_start, hole_end in holes:
        if hole_start > cursor:
            out.append((cursor, hole_start))
        cursor = hole_end
    if cursor < end:
        out.append((cursor, end))
    return out


class _Plan:
    """Who sends what in one gather of a bucket group, for one choice of recipes (the same on every rank).

    owned[b][i][q]: the row range (start, end) of weight i of bucket b whose bands lie in rank q's element range
    (empty when none, or when the weight travels in the parameter dtype); plain[b][q]: rank q's element intervals
    of bucket b that travel in the parameter dtype; per rank, its bytes in that order (all buckets' plain values,
    then every owned row range's wire pieces); size: the largest rank's bytes, what each rank sends."""

    def __init__(self, buckets: list, recipes: list, world_size: int):
        self.recipes = recipes
        self.owned, self.plain, rank_bytes = [], [], [0] * world_size
        for (bucket, weights), bucket_recipes in zip(buckets, recipes):
            shard = bucket.param_data.numel() // world_size
            element_size = bucket.param_data.element_size()
            owned = []
            for weight, recipe in zip(weights, bucket_recipes):
                ranges = []
                for q in range(world_size):
                    lo, hi = q * shard, (q + 1) * shard
                    first = max(0, -(-(lo - weight.offset) // weight.band))           # first band starting >= lo
                    last = min(weight.rows // BLOCK_SIZE, (hi - weight.offset) // weight.band)  # bands ending <= hi
                    ranges.append((first * BLOCK_SIZE, last * BLOCK_SIZE) if recipe is not None and last > first
                                  else (0, 0))
                owned.append(ranges)
            plain = []
            for q in range(world_size):
                holes = sorted((w.offset + start * w.cols, w.offset + end * w.cols)
                               for w, ranges in zip(weights, owned) for start, end in [ranges[q]] if end > start)
                plain.append(_subtract(q * shard, (q + 1) * shard, holes))
                rank_bytes[q] += sum(end - start for start, end in plain[q]) * element_size
            self.owned.append(owned)
            self.plain.append(plain)
        for (bucket, weights), bucket_recipes, owned in zip(buckets, recipes, self.owned):
            for weight, recipe, ranges in zip(weights, bucket_recipes, owned):
                if recipe is None:
                    continue
                for q, (start, end) in enumerate(ranges):
                    if end > start:
                        rank_bytes[q] += sharded_weight.wire_bytes((end - start, weight.cols), recipe[0],
                                                                   columnwise=recipe[1])
        self.rank_bytes = rank_bytes
        self.size = max(rank_bytes)


class _BucketGroupGather:
    """The NVFP4 gather of one Megatron bucket group, in place of its start_param_sync / finish_param_sync."""

    def __init__(self, owner: "NVFP4ParamGather", group, buckets: list):
        self.owner, self.group, self.buckets = owner, group, buckets  # buckets: [(bucket, [_Weight])]
        self.megatron_start, self.megatron_finish = group.start_param_sync, group.finish_param_sync
        self.process_group = group.intra_distributed_optimizer_instance_group
        self.world_size = group.intra_distributed_optimizer_instance_size
        self.rank = group.intra_distributed_optimizer_instance_rank
        self.plans: dict = {}
        self.templates: dict = {}
        self.pending = None        # (work, received bytes, plan, amaxes) of a dispatched gather
        self.bf16_stale = False    # whether some NVFP4 bands' parameter-dtype values were not gathered
        self.installed = False
        self.overlap = bool(group.ddp_config.overlap_param_gather)
        group.start_param_sync = self.start_param_sync
        group.finish_param_sync = self.finish_param_sync

    @property
    def weights(self) -> list:
        return [weight for _, weights in self.buckets for weight in weights]

    def restore(self) -> None:
        self.group.start_param_sync, self.group.finish_param_sync = self.megatron_start, self.megatron_finish

    # ---- Megatron's bucket-group protocol ------------------------------------------------------------------------

    def start_param_sync(self, force_sync: bool = False):
        """Megatron's start_param_sync: dispatch this group's gather (asynchronous with overlap_param_gather). With
        force_sync, finish any outstanding gather and run Megatron's own gather (whole parameters)."""
        if force_sync:
            self._wait()
            self.gather_bf16()
            return
        assert self.pending is None, "param gather dispatched twice"
        self._dispatch(async_op=self.overlap)
        self.group.param_gather_dispatched = True
        if not self.overlap:
            self._wait()

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        """Megatron's finish_param_sync (called by its forward pre-hooks): dispatch if not yet, wait, install the
        gathered weights, and dispatch the next bucket group's gather."""
        if not self.group.param_gather_dispatched:
            self.start_param_sync()
        if self.pending is None:
            return
        self._wait()
        following = self.group.next_param_gather_bucket_group
        if following is not None and not skip_next_bucket_dispatch and not following.param_gather_dispatched:
            following.start_param_sync()

    # ---- the gather ------------------------------------------------------------------------------------------------

    def gather_bf16(self) -> None:
        """Megatron's own (synchronous) gather of the whole bucket group; the layers quantize their weights again."""
        self.megatron_start(force_sync=True)
        self.bf16_stale = False
        self.uninstall()

    def uninstall(self) -> None:
        if not self.installed:
            return
        for weight in self.weights:
            weight.module.weight_cache.invalidate()
            weight.module.is_first_microbatch = None
        self.installed = False

    def _recipes(self) -> list:
        """Per bucket, per weight: (recipe, columnwise) of its layer's last forward, or None (parameter dtype)."""
        return [[(weight.module.last_recipe, needs_columnwise_weight(weight.module.last_recipe))
                 if _gathers_nvfp4(weight.module.last_recipe) else None for weight in weights]
                for _, weights in self.buckets]

    def _plan(self, recipes: list) -> _Plan:
        key = tuple(tuple(None if r is None else (id(r[0]), r[1]) for r in bucket) for bucket in recipes)
        plan = self.plans.get(key)
        if plan is None or plan.recipes != recipes:
            plan = self.plans[key] = _Plan(self.buckets, recipes, self.world_size)
        return plan

    def _amaxes(self, recipes: list) -> list:
        """Per bucket, per weight: the whole weight's amax (float32 (1,)) for weights gathered in NVFP4, in one
        all-reduce(MAX) of the amaxes of this rank's elements (each max(|min|, |max|) of them: one reduction
        pass), checked for NaN/Inf once for all weights whose recipe checks (the quantizations then do not)."""
        extremes, slots, checked = [], [], {}
        for (bucket, weights), bucket_recipes in zip(self.buckets, recipes):
            shard = bucket.param_data.numel() // self.world_size
            lo, hi = self.rank * shard, (self.rank + 1) * shard
            for weight, recipe in zip(weights, bucket_recipes):
                if recipe is None:
                    slots.append(None)
                    continue
                start, end = max(lo, weight.offset), min(hi, weight.offset + weight.rows * weight.cols)
                if end > start:
                    extremes.append(torch.stack(torch.aminmax(bucket.param_data[start:end].detach())))
                else:  # no element of this weight here: an empty range's amax, 0
                    extremes.append(torch.zeros(2, dtype=bucket.param_data.dtype, device=bucket.param_data.device))
                slots.append(len(extremes) - 1)
                if recipe[0].check_finite:
                    checked[weight.name] = len(extremes) - 1
        if not extremes:
            return [[None] * len(weights) for _, weights in self.buckets]
        stacked = torch.stack(extremes).abs().amax(dim=1).to(torch.float32)  # [weights]: max(|min|, |max|)
        collectives.all_reduce_amax([stacked], self.process_group)
        if checked:
            finite_check.check_amaxes({name: stacked[i:i + 1] for name, i in checked.items()},
                                      label="a weight of the NVFP4 param gather")
        amaxes, position = [], 0
        for _, weights in self.buckets:
            row = slots[position:position + len(weights)]
            position += len(weights)
            amaxes.append([None if slot is None else stacked[slot:slot + 1] for slot in row])
        return amaxes

    def _dispatch(self, async_op: bool) -> None:
        recipes = self._recipes()
        plan = self._plan(recipes)
        amaxes = self._amaxes(recipes) if any(r is not None for bucket in recipes for r in bucket) else None
        device = self.buckets[0][0].param_data.device
        send = torch.zeros(plan.size, dtype=torch.uint8, device=device)
        offset = 0
        for (bucket, _), plain in zip(self.buckets, plan.plain):
            for start, end in plain[self.rank]:
                values = bucket.param_data[start:end].view(torch.uint8)
                send[offset:offset + values.numel()].copy_(values)
                offset += values.numel()
        for (bucket, weights), bucket_recipes, owned, bucket_amaxes in zip(self.buckets, recipes, plan.owned,
                                                                           amaxes or [None] * len(self.buckets)):
            for weight, recipe, ranges, amax in zip(weights, bucket_recipes, owned,
                                                    bucket_amaxes or [None] * len(weights)):
                start, end = ranges[self.rank]
                if recipe is None or end <= start:
                    continue
                q = sharded_weight.quantize_shard(weight.values(bucket)[start:end], amax, recipe[0],
                                                  columnwise=recipe[1], check_finite=False)
                for piece in sharded_weight.wire_pieces(q).values():
                    flat = piece.reshape(-1)
                    send[offset:offset + flat.numel()].copy_(flat)
                    offset += flat.numel()
        assert offset == plan.rank_bytes[self.rank], (offset, plan.rank_bytes)
        received = torch.empty(self.world_size * plan.size, dtype=torch.uint8, device=device)
        work = collectives._all_gather_single(received, send, group=self.process_group, async_op=async_op)
        self.owner.bytes_sent += plan.size
        self.pending = (work, received.view(self.world_size, plan.size), plan, recipes, amaxes)

    def _wait(self) -> None:
        if self.pending is None:
            return
        work, received, plan, recipes, amaxes = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        offsets = [0] * self.world_size
        for (bucket, _), plain in zip(self.buckets, plan.plain):
            for q in range(self.world_size):
                for start, end in plain[q]:
                    target = bucket.param_data[start:end].view(torch.uint8)
                    if q != self.rank:
                        target.copy_(received[q, offsets[q]:offsets[q] + target.numel()])
                    offsets[q] += target.numel()
        self.bf16_stale = any(end > start for owned in plan.owned for ranges in owned for start, end in ranges)
        if amaxes is None:
            self.uninstall()
            return
        for (bucket, weights), bucket_recipes, owned, bucket_amaxes in zip(self.buckets, recipes, plan.owned, amaxes):
            for weight, recipe, ranges, amax in zip(weights, bucket_recipes, owned, bucket_amaxes):
                cache = weight.module.weight_cache
                if recipe is None:
                    cache.invalidate()
                    continue
                q = self._assemble(bucket, weight, recipe, ranges, amax, received, offsets)
                cache.install(q, recipe[0])
                weight.module.is_first_microbatch = False  # Megatron's adapters then reuse the installed copy
        self.installed = True

    def _template(self, weight: _Weight, recipe: tuple) -> NVFP4Tensor:
        """The metadata (no storage) of the weight quantized with recipe: flags, dtype, e4m3 bound."""
        key = (weight.cols, id(recipe[0]), recipe[1], weight.param.dtype)
        template = self.templates.get(key)
        if template is None or template[0] is not recipe[0]:
            probe = torch.zeros(BLOCK_SIZE, weight.cols, dtype=weight.param.dtype, device=weight.param.device)
            q = sharded_weight.quantize_shard(probe, torch.ones(1, device=probe.device), recipe[0],
                                              columnwise=recipe[1])
            template = self.templates[key] = (recipe[0], q.metadata())
        return template[1]

    def _assemble(self, bucket, weight: _Weight, recipe: tuple, ranges: list, amax: torch.Tensor,
                  received: torch.Tensor, offsets: list) -> NVFP4Tensor:
        """The weight's NVFP4Tensor from its row ranges' pieces: received from their ranks, or quantized here from
        the gathered parameter-dtype values for the bands no rank owned."""
        segments = []  # (row start, pieces)
        covered = []
        for q, (start, end) in enumerate(ranges):
            if end <= start:
                continue
            pieces = {}
            for name, shape in _piece_shapes(end - start, weight.cols, recipe[0], recipe[1]):
                count = shape[0] * shape[1]
                pieces[name] = received[q, offsets[q]:offsets[q] + count].view(shape)
                offsets[q] += count
            segments.append((start, pieces))
            covered.append((start, end))
        for start, end in _subtract(0, weight.rows, covered):
            q = sharded_weight.quantize_shard(weight.values(bucket)[start:end], amax, recipe[0], columnwise=recipe[1],
                                              check_finite=False)
            segments.append((start, sharded_weight.wire_pieces(q)))
        segments.sort(key=lambda segment: segment[0])
        names = [name for name, _ in _piece_shapes(BLOCK_SIZE, weight.cols, recipe[0], recipe[1])]
        gathered = {name: torch.cat([pieces[name] for _, pieces in segments],
                                    dim=1 if name.startswith("columnwise") else 0) for name in names}
        amax = amax.clone()
        template = dataclasses.replace(self._template(weight, recipe), shape=torch.Size((weight.rows, weight.cols)),
                                       amax_rowwise=amax, amax_columnwise=amax if "columnwise_data" in gathered
                                       else None)
        return sharded_weight.assemble_gathered(template, gathered, 1, columnwise=recipe[1])


class NVFP4ParamGather:
    """What enable_nvfp4_param_gather set up: the NVFP4 layers it covers (`layers`, qualified names), the bucket
    groups whose gather it replaced, and `bytes_sent`: the bytes this rank has handed to those gathers so far (each
    gather sends the same count from every rank)."""

    def __init__(self):
        self.layers: list = []
        self.groups: list = []
        self.bytes_sent = 0
        self._hooks: list = []

    def sync_bf16_weights(self) -> None:
        """Megatron's own gather of every covered bucket group (on every data-parallel rank together): the
        parameters hold the whole weights again (before a checkpoint save or anything that reads them)."""
        for group in self.groups:
            group._wait()
            group.gather_bf16()

    def disable(self) -> None:
        """Give the bucket groups their own gather back (after sync_bf16_weights) and the layers their caches."""
        self.sync_bf16_weights()
        for group in self.groups:
            group.restore()
            for weight in group.weights:
                weight.module.weight_cache = WeightCache()
        for hook in self._hooks:
            hook.remove()
        self.groups, self.layers, self._hooks = [], [], []


def _chunks(model_chunks) -> list:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    from megatron.core.distributed import DistributedDataParallel
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise ValueError(f"model_chunks[{index}] is a {type(chunk).__name__}: pass Megatron-Core's "
                             f"DistributedDataParallel model chunks (megatron.core.distributed)")
        config = chunk.ddp_config
        if not config.use_distributed_optimizer:
            raise ValueError(f"model_chunks[{index}]: ddp_config.use_distributed_optimizer=False; the NVFP4 param "
                             f"gather replaces the distributed optimizer's param all-gather")
        for option in ("use_megatron_fsdp", "reuse_grad_buf_for_mxfp8_param_ag"):
            if getattr(config, option, False):
                raise ValueError(f"model_chunks[{index}]: ddp_config.{option}=True is not supported by the NVFP4 "
                                 f"param gather")
    return chunks


def _offset_in(bucket, param: torch.nn.Parameter) -> Optional[int]:
    """The element offset of param's data in bucket.param_data, or None when it is not a view into it."""
    data = bucket.param_data
    if data is None or param.data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        return None
    offset = (param.data.data_ptr() - data.data_ptr()) // data.element_size()
    if not param.data.is_contiguous() or offset < 0 or offset + param.numel() > data.numel():
        return None
    return offset


def _layer_pre_hook(owner: NVFP4ParamGather, gather: _BucketGroupGather):
    def hook(module, args):
        cache = module.weight_cache
        if cache.gathered is None:
            return
        recipe = module.resolved_recipe()
        if cache.serves(recipe):
            module.is_first_microbatch = False
            return
        logger.info("%s: its recipe changed since its weight was gathered in NVFP4; gathering its bucket group in "
                    "the parameter dtype", module.layer_name or type(module).__name__)
        gather._wait()
        gather.gather_bf16()
    return hook


def _state_dict_pre_hook(gather: _BucketGroupGather):
    def hook(module, prefix, keep_vars):
        if gather.bf16_stale:
            raise RuntimeError(f"{prefix}weight: this rank holds only its own rows of the weight's current values "
                               f"(the NVFP4 param gather moved the rest in NVFP4); call sync_bf16_weights() on the "
                               f"NVFP4ParamGather on every data-parallel rank (or Megatron's "
                               f"disable_forward_pre_hook / start_param_sync(force_sync=True)) before reading the "
                               f"state dict")
    return hook


def _load_post_hook(gather: _BucketGroupGather):
    def hook(module, incompatible_keys):
        gather.uninstall()  # the loaded values are whole: the layer quantizes them
        gather.bf16_stale = False
    return hook


def enable_nvfp4_param_gather(model_chunks) -> NVFP4ParamGather:
    """Make Megatron-Core's distributed optimizer gather the weights of the NVFP4 linears (NVFP4ColumnParallelLinear,
    NVFP4LayerNormColumnParallelLinear, NVFP4RowParallelLinear; not bf16_fallback ones) in NVFP4.

    model_chunks: Megatron's DistributedDataParallel model chunk, or the list of them, built with
    `DistributedDataParallelConfig(use_distributed_optimizer=True)`; call it after building them (and the
    optimizer), before training. ValueError, before changing anything, for another wrapper or configuration, or a
    weight that does not cut into 16x16 blocks (naming the layer, its shape and the multiple it needs).
    """
    chunks = _chunks(model_chunks)
    found = []  # (chunk, name, module)
    for chunk in chunks:
        for name, module in chunk.module.named_modules():
            if (isinstance(module, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)) and not module.bf16_fallback
                    and module.weight.requires_grad):
                found.append((chunk, name, module))
    for chunk, name, module in found:
        sharded_weight.check_weight_sharding(module.weight.shape, 1, name=f"{name}.weight")
        if isinstance(module.weight_cache, GatheredNVFP4WeightCache):
            raise ValueError(f"{name}: the NVFP4 param gather is already enabled for this layer")
        if module.weight not in chunk.param_to_bucket_group:
            raise ValueError(f"{name}.weight is in none of the model chunk's bucket groups")
    by_group: dict = {}
    for chunk, name, module in found:
        group = chunk.param_to_bucket_group[module.weight]
        bucket = next(b for b in group.buckets if module.weight in b.params)
        offset = _offset_in(bucket, module.weight)
        if offset is None:
            raise ValueError(f"{name}.weight is not a view into its bucket's param buffer (Megatron maps the "
                             f"parameters into the buffer with use_distributed_optimizer=True)")
        rows, cols = module.weight.shape
        by_group.setdefault(id(group), (group, {}))[1].setdefault(id(bucket), (bucket, []))[1].append(
            _Weight(name, module, module.weight, offset, rows, cols))
    handle = NVFP4ParamGather()
    for group, buckets in by_group.values():
        entries = []
        for bucket, weights in buckets.values():
            weights.sort(key=lambda weight: weight.offset)
            entries.append((bucket, weights))
        gather = _BucketGroupGather(handle, group, entries)
        handle.groups.append(gather)
        for weight in gather.weights:
            module = weight.module
            module.weight_cache = GatheredNVFP4WeightCache()
            handle._hooks += [module.register_forward_pre_hook(_layer_pre_hook(handle, gather)),
                              module.register_state_dict_pre_hook(_state_dict_pre_hook(gather)),
                              module.register_load_state_dict_post_hook(_load_post_hook(gather))]
            handle.layers.append(weight.name)
    return handle
