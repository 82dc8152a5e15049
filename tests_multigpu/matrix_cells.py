"""The cells of the multi-GPU test matrix (tests_multigpu/matrix.py) and how each one is checked.

A cell is (world size, TP size, sequence parallel, overlap, recipe variant, layer kind); the world's
W / TP data-parallel replicas each get their own data and check independently. Per cell:

1. The parallel layer's output and gradients (input, weight, bias) against a single-device emulation of
   the same sharded math: every shard's operands quantized on the CPU by the independent oracle of
   tests/helpers/oracle.py (docs/numerics.md written again in numpy, sharing no code with the package, the
   kernels or the comm code), the GEMMs run by nvfp4_dist.gemm with the
   layer's own backend on the layer's device (reference on CPU, Triton emulation on Hopper, cuBLASLt on
   Blackwell; those backends are checked against the reference GEMM elsewhere, and by the b200 profile),
   partial outputs summed on one device. Tolerances (elementwise |got - want| <= allowed):
     exact                 everything that involves no cross-rank sum;
     BF16 reduction        a sum of t > 1 BF16 partials (all-reduce / reduce-scatter, plain or ring):
                           allowed = t * 2^-8 * sum_r |partial_r|  (t - 1 roundings in any order, and the
                           emulation's one), plus one BF16 step (2^-7 * |want|) when a bias is added after;
     bias gradient         a BF16 sum over tokens: one BF16 step + tokens * 2^-23 * sum |dy| (FP32 order);
     overlap on CUDA       the above plus the GEMM accumulation tolerance of docs/numerics.md §11 (8e-3 * (|want| + mean
                           |want|)), since chunked GEMMs may tile differently.
2. Cells with TP > 1 also against the same layer at TP = 1 (same full weights and data): relative L2
   error of every quantity <= TP1_RELATIVE_TOLERANCE = 0.4 (shards quantize with their own scales and
   draw their own stochastic rounding, so this comparison is loose by nature).
3. Overlap cells must show that the overlapped schedule ran (a pipelined ring schedule was called) and
   match the plain layer within the overlap tolerance. Every layer here supports overlap: an error from it fails
   the cell like any other.
4. Megatron GPT layer cells: one TransformerLayer from get_gpt_layer_nvfp4_spec at that TP/SP against the
   same layer at TP = 1: finite output and gradients (parameter shards against the matching slice;
   SP-replicated parameters summed over TP first), each within relative L2 MEGATRON_TP1_RELATIVE_TOLERANCE, and
   the RMS over all of them within MEGATRON_TP1_RMS_BOUND[tp][recipe] (NVFP4's noise, not a coarser one).
5. b200 profile cells: gemm(backend="cublaslt") against gemm(backend="emulated") and the reference GEMM
   (docs/numerics.md §11: atol = rtol = 8e-3), only where sm_100 exists.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nvfp4_dist
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from tests.helpers import emulation as E

RECIPES = {
    "default": dict(),  # 2D weights, RHT and SR on gradients
    "no_rht": dict(rht=False),
    "no_sr": dict(stochastic_rounding=False),
    "no_2d": dict(weight_2d=False),
    "row_scaled": dict(row_scaled_activation=True, rht=False, stochastic_rounding=False),
}
QUICK_RECIPES = ("default", "row_scaled")
LAYER_KINDS = ("column", "row", "mlp", "megatron")
GEMM_KIND = "gemm_cublaslt"  # the b200 profile's cells
WORLD_SIZES = (1, 2, 4, 8)
TP_SIZES = (1, 2, 4, 8)

# Loose TP=1 comparison (relative L2). Shards quantize with their own weight amax and draw their own SR
# bits, so TP=N and TP=1 differ by NVFP4 noise: up to 0.23 (layers) and 0.26 (Megatron layer, through
# attention) on the CPU matrix. The bounds leave ~1.7x / ~1.9x headroom; a dropped reduction or a wrong
# shard gives >= 0.7.
TP1_RELATIVE_TOLERANCE = 0.4
MEGATRON_TP1_RELATIVE_TOLERANCE = 0.35  # any one quantity of a Megatron cell; correct NVFP4 reaches 0.27 at TP=8
# Megatron cells: the RMS over the cell's quantities (output, input gradient, every parameter gradient, each at its
# worst rank) of the relative L2 distance TP=N vs TP=1. Shards quantize with their own weight amax and draw their
# own SR bits, so the two differ by NVFP4 noise, more with more shards. Each bound sits between what the CPU matrix
# gives correct NVFP4 (at the CPU and at the GPU shapes; the GPU's kernels give the same bytes) and what it gives
# when every block scale is one binade too large (2 x s_b, a coarser grid): at least 8% from each.
MEGATRON_TP1_RMS_BOUND = {
    2: {"default": 0.158, "no_rht": 0.164, "no_sr": 0.137, "no_2d": 0.148, "row_scaled": 0.138},
    4: {"default": 0.184, "no_rht": 0.190, "no_sr": 0.157, "no_2d": 0.175, "row_scaled": 0.161},
    8: {"default": 0.201, "no_rht": 0.209, "no_sr": 0.179, "no_2d": 0.188, "row_scaled": 0.182},
}
BF16_ROUNDING = 2.0 ** -8  # largest relative error of one rounding to BF16 (half a step)
BF16_ULP = 2.0 ** -7  # largest relative size of one BF16 step: two roundings of nearby values may differ by it
GEMM_TOLERANCE = 8e-3  # docs/numerics.md §11
SR_SEED_BASE = 20260
# What a cell may lack and still count as "not run" rather than failed: the machine's resources, named in the
# record's "missing" field. The driver fails on any other "not run".
MISSING_RESOURCES = ("gpus", "sm_100", "megatron-core", "max-world")


def not_run(reason: str, missing: str) -> dict:
    """A cell's result when this machine lacks `missing` (one of MISSING_RESOURCES)."""
    if missing not in MISSING_RESOURCES:
        raise ValueError(f"missing={missing!r} is not one of {MISSING_RESOURCES}")
    return dict(status="not run", reason=reason, missing=missing)


@dataclasses.dataclass(frozen=True)
class Cell:
    world: int
    tp: int
    sp: bool
    overlap: bool
    recipe: str
    kind: str

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def name(self) -> str:
        return (f"w{self.world}-tp{self.tp}-dp{self.dp}-{'sp' if self.sp else 'nosp'}-"
                f"{'overlap' if self.overlap else 'plain'}-{self.recipe}-{self.kind}")

    def describe(self) -> dict:
        return dict(world=self.world, tp=self.tp, dp=self.dp, sp=self.sp, overlap=self.overlap,
                    recipe=self.recipe, kind=self.kind, name=self.name)


@dataclasses.dataclass(frozen=True)
class Shapes:
    seq: int = 128
    batch: int = 2
    hidden: int = 256
    ffn: int = 512
    heads: int = 8

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    def problems(self, tp: int) -> list[str]:
        """Why these shapes cannot run at this TP size (empty when they can)."""
        found = []
        for name, size in (("hidden", self.hidden), ("ffn", self.ffn)):
            if size % (16 * tp):
                found.append(f"{name}={size} is not a multiple of 16 * tp = {16 * tp}")
        if self.seq % tp or self.tokens % (16 * tp):
            found.append(f"seq={self.seq} x batch={self.batch} must split into tp={tp} chunks of a multiple of "
                         f"16 tokens (sequence parallelism)")
        if self.heads % tp or self.hidden % self.heads:
            found.append(f"heads={self.heads} must divide hidden={self.hidden} and be divisible by tp={tp}")
        return found


def parallel_configs(world: int):
    """(tp, sp, overlap) of a world size: TP=1 is data-parallel only; overlap pipelines the SP comm."""
    for tp in TP_SIZES:
        if tp > world or world % tp:
            continue
        if tp == 1:
            yield 1, False, False
        else:
            yield from ((tp, False, False), (tp, True, False), (tp, True, True))


def enumerate_cells(world: int, *, quick: bool = False, profile: str | None = None) -> list[Cell]:
    """Every cell of one world size, in the order the launch runs them (the same on every rank)."""
    recipes = QUICK_RECIPES if quick else tuple(RECIPES)
    cells = [Cell(world, tp, sp, overlap, recipe, kind)
             for tp, sp, overlap in parallel_configs(world) for kind in LAYER_KINDS for recipe in recipes]
    if profile == "b200":
        cells += [Cell(world, 1, False, False, recipe, GEMM_KIND) for recipe in recipes]
    return cells


def make_recipe(cell: Cell, *, overlap: bool | None = None) -> nvfp4_dist.NVFP4Recipe:
    """The cell's recipe, explicit (environment overrides do not reach the matrix); overlap cells pipeline every
    layer, however small and whatever the links (overlap_min_chunk_gflops=0, overlap_measure_links=False), as the
    matrix checks the ring schedules."""
    return nvfp4_dist.NVFP4Recipe(**RECIPES[cell.recipe], overlap=cell.overlap if overlap is None else overlap,
                                  overlap_min_chunk_gflops=0, overlap_measure_links=False)


# ------------------------------------------------------------------------------------------------------
# Run context: this process's place in the world and its tensor-parallel groups.

@dataclasses.dataclass
class Context:
    world: int
    rank: int
    device: torch.device
    shapes: Shapes
    groups: dict  # tp size -> this rank's TP group (consecutive ranks; TP=1: a group of one)
    seed: int = 1234

    @classmethod
    def create(cls, device: torch.device, shapes: Shapes, seed: int = 1234) -> "Context":
        """Collective: creates the TP groups of every TP size (dist.new_group on every rank, same order)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = {}
        for tp in TP_SIZES:
            if tp > world or world % tp:
                continue
            for replica in range(world // tp):
                group = dist.new_group(list(range(replica * tp, (replica + 1) * tp)))
                if replica == rank // tp:
                    groups[tp] = group
        return cls(world, rank, device, shapes, groups, seed)

    def replica(self, tp: int) -> int:
        return self.rank // tp

    def tp_rank(self, tp: int) -> int:
        return self.rank % tp

    def generator(self, *key: int) -> torch.Generator:
        value = self.seed
        for part in key:
            value = value * 1000003 + part
        return torch.Generator().manual_seed(value % (2 ** 62))


# ------------------------------------------------------------------------------------------------------
# Comparisons.

class Checks:
    """The comparisons of one cell on this rank: max error per quantity, and the failed ones."""

    def __init__(self):
        self.max_abs_err: dict[str, float] = {}
        self.tp1_rel_err: dict[str, float] = {}
        self.failures: list[str] = []

    def against(self, name: str, got, want: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        """|got - want| <= allowed elementwise (allowed None: exact)."""
        if got is None:
            self.failures.append(f"{name}: missing (None)")
            return
        if tuple(got.shape) != tuple(want.shape):
            self.failures.append(f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
            return
        got32, want32 = got.detach().float(), want.detach().to(got.device).float()
        diff = (got32 - want32).abs()
        finite = bool(torch.isfinite(got32).all())
        error = float(diff.max()) if diff.numel() else 0.0
        self.max_abs_err[name] = error if finite else float("inf")
        bound = torch.zeros_like(diff) if allowed is None else allowed.to(got.device).float()
        if not finite:
            self.failures.append(f"{name}: non-finite values")
        elif bool((diff > bound).any()):
            worst = int((diff - bound).argmax())
            self.failures.append(f"{name}: max |err| {error:.3e}, worst element {worst}: |err| "
                                 f"{float(diff.flatten()[worst]):.3e} > allowed {float(bound.flatten()[worst]):.3e}")

    def relative(self, name: str, got, want: torch.Tensor, tolerance: float = TP1_RELATIVE_TOLERANCE) -> None:
        """Relative L2 error ||got - want|| / ||want|| <= tolerance (the loose TP=1 comparison)."""
        if got is None or tuple(got.shape) != tuple(want.shape):
            self.failures.append(f"{name} vs TP=1: shape {None if got is None else tuple(got.shape)} != "
                                 f"{tuple(want.shape)}")
            return
        got32, want32 = got.detach().float(), want.detach().to(got.device).float()
        if not bool(torch.isfinite(got32).all()):
            self.tp1_rel_err[name] = float("inf")
            self.failures.append(f"{name} vs TP=1: non-finite values")
            return
        error = float((got32 - want32).norm() / want32.norm().clamp_min(1e-30))
        self.tp1_rel_err[name] = error
        if error > tolerance:
            self.failures.append(f"{name} vs TP=1: relative L2 error {error:.3f} > {tolerance}")


def reduced(partials: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the (BF16 partial, allowed error) pairs, rounded once, and its allowed error.

    A cross-rank sum in any order rounds t - 1 times and the emulation once, each by at most
    2^-8 * sum_r |partial_r|: t * 2^-8 * sum_r |partial_r| (0 for t = 1), on top of the partials' own allowances.
    """
    values = [p for p, _ in partials]
    total = torch.stack([p.float() for p in values]).sum(0)
    magnitude = torch.stack([p.float().abs() for p in values]).sum(0)
    roundings = len(values) if len(values) > 1 else 0
    allowed = roundings * BF16_ROUNDING * magnitude + torch.stack([a for _, a in partials]).sum(0)
    return total.to(values[0].dtype), allowed


def bias_grad_allowed(want: torch.Tensor, dy2d: torch.Tensor) -> torch.Tensor:
    """One BF16 rounding of a token sum plus its FP32 accumulation error (any summation order)."""
    return BF16_ULP * want.float().abs() + dy2d.shape[0] * 2.0 ** -23 * dy2d.float().abs().sum(0)


def gemm_allowance(want: torch.Tensor) -> torch.Tensor:
    """docs/numerics.md §11's GEMM accumulation-order tolerance, scaled to the tensor's magnitude."""
    magnitude = want.float().abs()
    return GEMM_TOLERANCE * (magnitude + magnitude.mean())


# ------------------------------------------------------------------------------------------------------
# The single-device emulation of the sharded math (all shards of one TP group, on one device).

def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Emulation:
    """Quantize with the independent oracle on the CPU; GEMMs on `device` like the layer. Values come with their
    allowed error (zeros: the GEMMs are exact)."""

    def __init__(self, recipe: nvfp4_dist.NVFP4Recipe, device: torch.device):
        self.recipe, self.device = recipe, device

    def _to(self, q):
        return None if q is None else q.to(self.device)

    def activation(self, x2d: torch.Tensor):
        row, col = E.quantize_activation(x2d.cpu(), self.recipe)
        return self._to(row), self._to(col)

    def weight(self, w: torch.Tensor):
        return self._to(E.quantize_weight(w.cpu(), self.recipe))

    def gradient(self, dy2d: torch.Tensor, seed: int | None):
        row, col = E.quantize_gradient(dy2d.cpu(), self.recipe, seed)
        return self._to(row), self._to(col)

    def gemm(self, a, b, a_copy, b_copy, out_dtype, bias=None):
        """NVFP4 GEMM with the layer's backend: exact (a deterministic GEMM of the same shapes)."""
        out = nvfp4_dist.gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias,
                              recipe=self.recipe)
        return out, torch.zeros(out.shape, device=out.device)

    # Column-parallel: weight [out/t, in] per shard, input shared (gathered under SP).
    def column_forward(self, x2d, w_full, b_full, t):
        """Each shard's output [tokens, out/t] (exact) and what backward needs."""
        xq_row, xq_col = self.activation(x2d)
        wq = [self.weight(w) for w in w_full.chunk(t, 0)]
        ys = [self.gemm(xq_row, wq[k], "rowwise", "rowwise", x2d.dtype, bias=b.detach())[0]
              for k, b in enumerate(b_full.chunk(t, 0))]
        return ys, dict(xq_row=xq_row, xq_col=xq_col, wq=wq)

    def column_backward(self, dy_shards, saved, seed, weight_dtype):
        """([(dx partial, allowed)] per shard, [(dW, allowed)] per shard) for output-gradient shards."""
        partials, weight_grads = [], []
        for k, dy2d in enumerate(dy_shards):
            dyq_row, dyq_col = self.gradient(dy2d, seed)
            partials.append(self.gemm(dyq_row, saved["wq"][k], "rowwise", "columnwise", dy2d.dtype))
            weight_grads.append(self.gemm(dyq_col, saved["xq_col"], "columnwise", "columnwise", weight_dtype))
        return partials, weight_grads

    # Row-parallel: weight [out, in/t] per shard, input split along its last dim.
    def row_forward(self, x_shards, w_full, t):
        """Each shard's partial output [tokens, out] (exact, before the reduction) and what backward needs."""
        xq = [self.activation(x2d) for x2d in x_shards]
        wq = [self.weight(w) for w in w_full.chunk(t, 1)]
        partials = [self.gemm(xq[k][0], wq[k], "rowwise", "rowwise", x_shards[k].dtype) for k in range(t)]
        return partials, dict(xq=xq, wq=wq)

    def row_backward(self, dy2d, saved, seed, weight_dtype):
        """([(dx, allowed)] per shard, [(dW, allowed)] per shard) for the full output gradient."""
        input_grads, weight_grads = [], []
        dyq_row, dyq_col = self.gradient(dy2d, seed)
        for (_, xq_col), wq in zip(saved["xq"], saved["wq"]):
            input_grads.append(self.gemm(dyq_row, wq, "rowwise", "columnwise", dy2d.dtype))
            weight_grads.append(self.gemm(dyq_col, xq_col, "columnwise", "columnwise", weight_dtype))
        return input_grads, weight_grads


def draw_seeds(count: int, recipe, device: torch.device) -> list:
    """The SR seeds `count` successive layer backwards on `device` draw after torch.manual_seed(SR_SEED_BASE)."""
    torch.manual_seed(SR_SEED_BASE)
    if not recipe.stochastic_rounding:
        return [None] * count
    like = torch.empty(0, device=device)
    return [int(nvfp4_dist.ops.draw_sr_seed(like)) for _ in range(count)]


# ------------------------------------------------------------------------------------------------------
# Layer cells: column, row, MLP pair (column -> GELU -> row).

@dataclasses.dataclass
class LayerData:
    """One replica's full tensors: input, output gradient, and the full weights/biases of each linear."""

    x: torch.Tensor
    dy: torch.Tensor
    weights: list
    biases: list


def layer_data(ctx: Context, cell: Cell, replica: int) -> LayerData:
    s = ctx.shapes
    widths = {"column": [(s.hidden, s.ffn)], "row": [(s.ffn, s.hidden)],
              "mlp": [(s.hidden, s.ffn), (s.ffn, s.hidden)]}[cell.kind]
    generator = ctx.generator(replica, LAYER_KINDS.index(cell.kind), list(RECIPES).index(cell.recipe))
    x = torch.randn(s.seq, s.batch, widths[0][0], generator=generator)
    dy = torch.randn(s.seq, s.batch, widths[-1][1], generator=generator)
    weights = [torch.randn(out, inp, generator=generator) * inp ** -0.5 for inp, out in widths]
    biases = [torch.randn(out, generator=generator) * 0.1 for _, out in widths]
    move = lambda t, dtype: t.to(device=ctx.device, dtype=dtype)  # noqa: E731
    return LayerData(move(x, torch.bfloat16), move(dy, torch.bfloat16), [move(w, torch.float32) for w in weights],
                     [move(b, torch.float32) for b in biases])


def build_linears(cell: Cell, data: LayerData, group, recipe, device) -> list:
    """The cell's parallel linears, initialised from the full weights (each rank keeps its shard)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = []
    kinds = {"column": ["column"], "row": ["row"], "mlp": ["column", "row"]}[cell.kind]
    for kind, w_full, b_full in zip(kinds, data.weights, data.biases):
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        layer = cls(w_full.shape[1], w_full.shape[0], bias=True, tp_group=group, sequence_parallel=cell.sp and tp > 1,
                    init_method=lambda full, w=w_full: full.copy_(w), recipe=recipe, device=device)
        with torch.no_grad():
            layer.bias.copy_(b_full.chunk(tp, 0)[rank] if kind == "column" else b_full)
        layers.append(layer)
    return layers


def local_input(cell: Cell, data: LayerData, tp: int, rank: int, sp: bool) -> torch.Tensor:
    if cell.kind == "row":
        return data.x.chunk(tp, -1)[rank].contiguous()
    return data.x.chunk(tp, 0)[rank].contiguous() if sp else data.x


def local_grad_output(cell: Cell, data: LayerData, tp: int, rank: int, sp: bool) -> torch.Tensor:
    if cell.kind == "column":
        return data.dy.chunk(tp, -1)[rank].contiguous()
    return data.dy.chunk(tp, 0)[rank].contiguous() if sp else data.dy


def run_layers(cell: Cell, data: LayerData, group, recipe, device) -> dict:
    """Forward and backward of the cell's layers at this TP group; the outputs and gradients on this rank."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    sp = cell.sp and tp > 1
    layers = build_linears(cell, data, group, recipe, device)
    x = local_input(cell, data, tp, rank, sp).clone().requires_grad_(True)
    y, _ = layers[0](x)
    if cell.kind == "mlp":
        y, _ = layers[1](F.gelu(y))
    torch.manual_seed(SR_SEED_BASE)  # the SR seeds the backwards draw (see draw_seeds)
    y.backward(local_grad_output(cell, data, tp, rank, sp))
    result = {"y": y.detach(), "dx": x.grad}
    for index, layer in enumerate(layers):
        result[f"dW{index + 1}"] = layer.weight.grad
        result[f"db{index + 1}"] = layer.bias.grad
    return result


def emulate(cell: Cell, data: LayerData, tp: int, rank: int, recipe) -> tuple[dict, dict]:
    """(expected values, allowed errors) of run_layers' quantities on this rank, from the emulation."""
    emulation = Emulation(recipe.replace(overlap=False), data.x.device)
    sp = cell.sp and tp > 1
    seq, batch = data.x.shape[:2]
    want, allowed = {}, {}

    def rows(t2d):  # this rank's part of a [tokens, n] tensor as [s, b, n], or [s/tp, b, n] under SP
        return t2d.reshape(seq, batch, -1).chunk(tp, 0)[rank] if sp else t2d.reshape(seq, batch, -1)

    def expect(name, value_allowed, view=lambda t: t):
        want[name], allowed[name] = view(value_allowed[0]), view(value_allowed[1])

    seeds = draw_seeds(2 if cell.kind == "mlp" else 1, recipe, data.x.device)
    x2d, dy2d = flat(data.x), flat(data.dy)
    if cell.kind in ("column", "mlp"):
        w1, b1 = data.weights[0], data.biases[0]
        hidden_shards, saved1 = emulation.column_forward(x2d, w1, b1, tp)
    if cell.kind == "column":
        want["y"] = hidden_shards[rank].reshape(seq, batch, -1)
        dy_shards = [c.contiguous() for c in dy2d.chunk(tp, -1)]
        partials, weight_grads = emulation.column_backward(dy_shards, saved1, seeds[0], w1.dtype)
        expect("dx", reduced(partials), rows)
        expect("dW1", weight_grads[rank])
        want["db1"] = dy_shards[rank].sum(0).to(b1.dtype)
        allowed["db1"] = bias_grad_allowed(want["db1"], dy_shards[rank])
        return want, allowed

    if cell.kind == "row":
        row_inputs = [c.contiguous() for c in x2d.chunk(tp, -1)]
        w2, b2, index = data.weights[0], data.biases[0], "1"
    else:
        row_inputs = [F.gelu(h) for h in hidden_shards]
        w2, b2, index = data.weights[1], data.biases[1], "2"
    partials, saved2 = emulation.row_forward(row_inputs, w2, tp)
    y_sum, y_allowed = reduced(partials)
    want["y"] = rows(y_sum) + b2.to(y_sum.dtype)
    allowed["y"] = rows(y_allowed) + (BF16_ULP * want["y"].float().abs() if tp > 1 else 0)
    dy_local = data.dy.chunk(tp, 0)[rank] if sp else data.dy
    want[f"db{index}"] = dy_local.sum(dim=tuple(range(dy_local.dim() - 1))).to(b2.dtype)
    allowed[f"db{index}"] = bias_grad_allowed(want[f"db{index}"], flat(dy_local))
    input_grads, weight_grads = emulation.row_backward(dy2d, saved2, seeds[0], w2.dtype)
    expect(f"dW{index}", weight_grads[rank])
    if cell.kind == "row":
        expect("dx", input_grads[rank], lambda t: t.reshape(seq, batch, -1))
        return want, allowed

    # MLP: GELU backward on every shard (exact input gradients), then the column-parallel backward.
    dy_shards = [torch.ops.aten.gelu_backward(g, h) for (g, _), h in zip(input_grads, hidden_shards)]
    partials, weight_grads1 = emulation.column_backward(dy_shards, saved1, seeds[1], w1.dtype)
    expect("dx", reduced(partials), rows)
    expect("dW1", weight_grads1[rank])
    want["db1"] = dy_shards[rank].sum(0).to(b1.dtype)
    allowed["db1"] = bias_grad_allowed(want["db1"], dy_shards[rank])
    return want, allowed


def tp1_slices(cell: Cell, reference: dict, tp: int, rank: int, sp: bool) -> dict:
    """This rank's part of each TP=1 quantity (what the TP group's layer holds on this rank)."""
    def rows(t):
        return t.chunk(tp, 0)[rank] if sp else t
    out = {}
    for name, value in reference.items():
        if name == "y":
            out[name] = value.chunk(tp, -1)[rank] if cell.kind == "column" else rows(value)
        elif name == "dx":
            out[name] = value.chunk(tp, -1)[rank] if cell.kind == "row" else rows(value)
        elif name == "dW1" and cell.kind in ("column", "mlp"):
            out[name] = value.chunk(tp, 0)[rank]
        elif name in ("dW1", "dW2"):
            out[name] = value.chunk(tp, 1)[rank]
        elif name == "db1" and cell.kind in ("column", "mlp"):
            out[name] = value.chunk(tp, 0)[rank]
        else:  # the row-parallel bias: replicated (its SP gradient is summed over the group first)
            out[name] = value
    return out


@contextlib.contextmanager
def ring_schedule_counter():
    """Counts the overlapped layers' pipelined ring schedules run inside the block (either transport: NCCL
    point-to-point rings, or copy engines through symmetric memory)."""
    from nvfp4_dist.parallel import overlap
    counter = {"ring_schedules": 0}
    originals = (overlap.ring_all_gather_consume, overlap.ring_reduce_scatter_produce)

    def counting(original):
        def wrapped(*args, **kwargs):
            counter["ring_schedules"] += 1
            return original(*args, **kwargs)
        return wrapped
    overlap.ring_all_gather_consume, overlap.ring_reduce_scatter_produce = map(counting, originals)
    try:
        yield counter
    finally:
        overlap.ring_all_gather_consume, overlap.ring_reduce_scatter_produce = originals


def run_layer_cell(cell: Cell, ctx: Context) -> dict:
    """One column / row / MLP cell on this rank: {'status', 'reason', 'max_abs_err', 'tp1_rel_err', ...}."""
    tp = cell.tp
    group, rank = ctx.groups[tp], ctx.tp_rank(tp)
    sp = cell.sp and tp > 1
    recipe = make_recipe(cell)
    data = layer_data(ctx, cell, ctx.replica(tp))
    checks = Checks()
    extra = {}
    if cell.overlap:
        with ring_schedule_counter() as counter:
            got = run_layers(cell, data, group, recipe, ctx.device)
        extra["ring_schedules"] = counter["ring_schedules"]
        if counter["ring_schedules"] == 0:
            checks.failures.append("recipe.overlap=True but no pipelined ring schedule ran "
                                   "(the layers ignore the overlap switch)")
        plain = run_layers(cell, data, group, make_recipe(cell, overlap=False), ctx.device)
    else:
        got = run_layers(cell, data, group, recipe, ctx.device)
    want, allowed = emulate(cell, data, tp, rank, recipe)
    for name in want:
        reduction = allowed.get(name)  # None: exact
        bound = reduction
        if cell.overlap and ctx.device.type == "cuda":
            bound = gemm_allowance(want[name]) + (0 if reduction is None else reduction)
        checks.against(name, got[name], want[name], bound)
        if cell.overlap:  # |overlapped - plain| <= both paths' allowed distance from the emulation
            vs_plain = None if bound is None else bound + (0 if reduction is None else reduction)
            checks.against(f"{name} overlap vs plain", got[name], plain[name], vs_plain)
    if tp > 1:
        single = run_layers(cell, data, ctx.groups[1], make_recipe(cell, overlap=False), ctx.device)
        expected = tp1_slices(cell, single, tp, rank, sp)
        row_bias = {"row": "db1", "mlp": "db2"}.get(cell.kind)
        for name, value in got.items():
            if sp and name == row_bias:
                value = value.clone()
                dist.all_reduce(value, group=group)  # the SP-marked row bias: partial sums per rank
            checks.relative(name, value, expected[name])
    return finish(checks, extra)


def finish(checks: Checks, extra: dict | None = None) -> dict:
    return dict(status="failed" if checks.failures else "passed", reason="; ".join(checks.failures),
                max_abs_err=checks.max_abs_err, tp1_rel_err=checks.tp1_rel_err, **(extra or {}))


# ------------------------------------------------------------------------------------------------------
# b200 profile: the native cuBLASLt NVFP4 GEMM against the Hopper emulation and the reference GEMM.

def sm100_reason(device: torch.device) -> str | None:
    """None when cuBLASLt NVFP4 can run here, else why not."""
    if device.type != "cuda":
        return f"needs sm_100 (device is {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        return f"needs sm_100 (this GPU is sm_{major}{minor})"
    return None


def run_gemm_cell(cell: Cell, ctx: Context) -> dict:
    reason = sm100_reason(ctx.device)
    if reason:
        return not_run(reason, "sm_100")
    recipe = make_recipe(cell)
    s = ctx.shapes
    generator = ctx.generator(ctx.rank, 99, list(RECIPES).index(cell.recipe))
    x = torch.randn(s.tokens, s.hidden, generator=generator).to(ctx.device, torch.bfloat16)
    w = (torch.randn(s.ffn, s.hidden, generator=generator) * s.hidden ** -0.5).to(ctx.device)
    dy = torch.randn(s.tokens, s.ffn, generator=generator).to(ctx.device, torch.bfloat16)
    xq = nvfp4_dist.quantize(x, "activation", recipe=recipe)
    wq = nvfp4_dist.quantize(w, "weight", recipe=recipe)
    dyq = nvfp4_dist.quantize(dy, "gradient", recipe=recipe)
    products = {"fprop": (xq, wq, "rowwise", "rowwise"), "dgrad": (dyq, wq, "rowwise", "columnwise"),
                "wgrad": (dyq, xq, "columnwise", "columnwise")}
    checks = Checks()
    for name, (a, b, a_copy, b_copy) in products.items():
        outputs = {backend: nvfp4_dist.gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=torch.bfloat16,
                                            backend=backend) for backend in ("cublaslt", "emulated", "reference")}
        native = outputs["cublaslt"]
        for other in ("emulated", "reference"):
            want = outputs[other]
            checks.against(f"{name} cublaslt vs {other}", native, want,
                           GEMM_TOLERANCE + GEMM_TOLERANCE * want.float().abs())
    return finish(checks)


# ------------------------------------------------------------------------------------------------------
# Megatron GPT layer cells.

def megatron_missing() -> str | None:
    """None when megatron-core and the NVFP4 spec import, else the reason."""
    try:
        import nvfp4_dist.parallel.megatron  # noqa: F401
    except ImportError as error:
        return f"megatron-core missing ({error})"
    return None


class MegatronPhase:
    """Builds Megatron TransformerLayers at each TP size (Megatron's groups re-initialised per TP size)."""

    def __init__(self, ctx: Context):
        from megatron.core import parallel_state
        self.ctx, self.parallel_state = ctx, parallel_state
        self.tp = None
        self.references: dict = {}
        if ctx.device.type == "cpu":
            # Megatron's helpers allocate on torch.cuda.current_device(); on a CPU run that is the CPU.
            torch.cuda.current_device = lambda: torch.device("cpu")

    def use_tp(self, tp: int) -> None:
        if self.tp == tp:
            return
        self.parallel_state.destroy_model_parallel()
        self.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        if self.ctx.device.type == "cuda":
            from megatron.core import tensor_parallel
            tensor_parallel.model_parallel_cuda_manual_seed(self.ctx.seed)
        self.tp = tp

    def close(self) -> None:
        self.parallel_state.destroy_model_parallel()

    def config(self, tp: int, sp: bool):
        from megatron.core.transformer.transformer_config import TransformerConfig
        s = self.ctx.shapes
        return TransformerConfig(
            num_layers=1, hidden_size=s.hidden, ffn_hidden_size=s.ffn, num_attention_heads=s.heads,
            tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
            perform_initialization=True, params_dtype=torch.bfloat16, bf16=True, add_bias_linear=True,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0,
            attention_dropout=0.0, init_method_std=0.02)

    def data(self, recipe_name: str, replica: int):
        s = self.ctx.shapes
        generator = self.ctx.generator(replica, 77, list(RECIPES).index(recipe_name))
        x = torch.randn(s.seq, s.batch, s.hidden, generator=generator)
        dy = torch.randn(s.seq, s.batch, s.hidden, generator=generator)
        return x.to(self.ctx.device, torch.bfloat16), dy.to(self.ctx.device, torch.bfloat16)

    def run(self, cell: Cell, tp: int, sp: bool, recipe) -> dict:
        """Output, input grad and parameter grads of one layer at the current TP size, on this rank."""
        from megatron.core.transformer.spec_utils import build_module
        from nvfp4_dist.parallel.megatron import get_gpt_layer_nvfp4_spec
        spec = get_gpt_layer_nvfp4_spec(recipe=recipe, sdpa_attention=True)
        torch.manual_seed(self.ctx.seed)  # same full weights at every TP size
        layer = build_module(spec, config=self.config(tp, sp), layer_number=1).to(self.ctx.device)
        x_full, dy_full = self.data(cell.recipe, self.ctx.replica(cell.tp))
        rank = self.ctx.tp_rank(tp) if tp > 1 else 0
        x = (x_full.chunk(tp, 0)[rank] if sp else x_full).contiguous().requires_grad_(True)
        out = layer(hidden_states=x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        torch.manual_seed(SR_SEED_BASE)
        out.backward((dy_full.chunk(tp, 0)[rank] if sp else dy_full).contiguous())
        grads = {f"grad {name}": (param.grad, param) for name, param in layer.named_parameters()}
        return {"y": (out.detach(), None), "dx": (x.grad, None), **grads}

    def prepare(self, cells: list[Cell]) -> None:
        """The TP=1 reference of every Megatron cell of this rank, at TP=1 (the one collective re-init)."""
        self.use_tp(1)
        for cell in cells:
            key = (cell.recipe, self.ctx.replica(cell.tp))
            if key not in self.references:
                try:
                    self.references[key] = self.run(cell, 1, False, make_recipe(cell, overlap=False))
                except Exception as error:  # noqa: BLE001 - recorded as the failure of the cells needing it
                    self.references[key] = error

    def run_cell(self, cell: Cell) -> dict:
        """Collective over the world when it changes Megatron's TP size (cells must come in TP order)."""
        tp, sp = cell.tp, cell.sp and cell.tp > 1
        self.use_tp(tp)
        reference = self.references[(cell.recipe, self.ctx.replica(cell.tp))]
        if isinstance(reference, Exception):
            raise RuntimeError(f"the TP=1 reference layer failed: {type(reference).__name__}: {reference}")
        recipe = make_recipe(cell)
        extra = {}
        with ring_schedule_counter() as counter:
            got = self.run(cell, tp, sp, recipe)
        checks = Checks()
        if cell.overlap:
            extra["ring_schedules"] = counter["ring_schedules"]
            if counter["ring_schedules"] == 0:
                checks.failures.append("recipe.overlap=True but no pipelined ring schedule ran")
        rank = self.ctx.tp_rank(tp)
        group = self.parallel_state.get_tensor_model_parallel_group()
        for name, (value, param) in got.items():
            want = reference[name][0]
            if value is None:
                checks.failures.append(f"{name}: no gradient")
                continue
            if name in ("y", "dx"):
                want = want.chunk(tp, 0)[rank] if sp else want
            elif getattr(param, "tensor_model_parallel", False):
                want = want.chunk(tp, param.partition_dim)[rank]
            elif sp and getattr(param, "sequence_parallel", False):
                value = value.float()
                dist.all_reduce(value, group=group)  # SP-replicated parameters: per-rank partial gradients
            checks.relative(name, value, want, MEGATRON_TP1_RELATIVE_TOLERANCE)  # TP=1 cells: a rebuild
        if tp > 1:
            worst = torch.tensor([checks.tp1_rel_err.get(name, float("inf")) for name in got], dtype=torch.float64,
                                 device=self.ctx.device)  # NCCL groups reduce CUDA tensors only
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            rms = float(worst.pow(2).mean().sqrt())
            extra["tp1_rel_err_rms"] = rms
            bound = MEGATRON_TP1_RMS_BOUND[tp][cell.recipe]
            if not rms <= bound:
                checks.failures.append(f"RMS of the relative L2 errors vs TP=1 {rms:.3f} > {bound} (coarser than "
                                       f"NVFP4's noise)")
        return finish(checks, extra)


# ------------------------------------------------------------------------------------------------------

def run_cell(cell: Cell, ctx: Context, megatron: MegatronPhase | None, megatron_reason: str | None) -> dict:
    """One cell on this rank, with its time; exceptions make the cell fail with their summary."""
    start = time.perf_counter()
    try:
        problems = ctx.shapes.problems(cell.tp)
        if problems:
            result = dict(status="failed", reason="shapes: " + "; ".join(problems))
        elif cell.kind == GEMM_KIND:
            result = run_gemm_cell(cell, ctx)
        elif cell.kind == "megatron":
            result = not_run(megatron_reason, "megatron-core") if megatron_reason else megatron.run_cell(cell)
        else:
            result = run_layer_cell(cell, ctx)
    except Exception as error:  # noqa: BLE001 - a cell's failure is recorded, the matrix goes on
        lines = traceback.format_exception(type(error), error, error.__traceback__)
        result = dict(status="failed", reason=f"{type(error).__name__}: {error}", traceback="".join(lines[-6:]))
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    result["seconds"] = time.perf_counter() - start
    return result
