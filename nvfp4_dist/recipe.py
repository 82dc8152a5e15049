"""NVFP4Recipe: every option of docs/numerics.md section 10, with environment overrides."""
import dataclasses
import functools
import hashlib
import types
import typing

from nvfp4_dist import environment
from nvfp4_dist.environment import (BACKWARD_MODES, FOUR_OVER_SIX_ERR_MODES, FOUR_OVER_SIX_SCOPES, GEMM_BACKENDS,
                                    MOE_DISPATCH_DTYPES, OVERLAP_TRANSPORTS)

# Flag variable -> (field, value it sets when the variable is 1).
_FLAG_OVERRIDES = (
    (environment.DISABLE_RHT, "rht", False),
    (environment.DISABLE_SR, "stochastic_rounding", False),
    (environment.DISABLE_2D, "weight_2d", False),
    (environment.ROW_SCALED_ACTIVATION, "row_scaled_activation", True),
    (environment.RHT_NO_RANDOM_SIGN, "rht_random_sign", False),
    (environment.OVERLAP, "overlap", True),
    (environment.OVERLAP_IGNORE_LINKS, "overlap_measure_links", False),
    (environment.FOUR_OVER_SIX_ERR_USE_FAST_MATH, "nvfp4_4over6_err_use_fast_math", True),
    (environment.DISABLE_FUSED_PRODUCERS, "fused_producers", False),
)
# Variable -> the field it sets when given.
_VALUE_OVERRIDES = (
    (environment.BF16_FIRST_LAYERS, "bf16_first_layers"),
    (environment.BF16_LAST_LAYERS, "bf16_last_layers"),
    (environment.OVERLAP_MIN_CHUNK_GFLOPS, "overlap_min_chunk_gflops"),
    (environment.OVERLAP_TRANSPORT, "overlap_transport"),
    (environment.GEMM_BACKEND, "gemm_backend"),
    (environment.FOUR_OVER_SIX, "nvfp4_4over6"),
    (environment.FOUR_OVER_SIX_E4M3_USE_256, "nvfp4_4over6_e4m3_use_256"),
    (environment.FOUR_OVER_SIX_ERR_MODE, "nvfp4_4over6_err_mode"),
    (environment.BACKWARD_MODE, "backward_mode"),
    (environment.MOE_DISPATCH, "moe_dispatch"),
)
# Every variable from_env reads (its cache key), and the recipes it built, by their settings.
_RECIPE_VARIABLES = tuple(dict.fromkeys(entry[0] for entry in _FLAG_OVERRIDES + _VALUE_OVERRIDES))
_RECIPE_NAMES = tuple(variable.name for variable in _RECIPE_VARIABLES)
_FROM_ENV_RECIPES: dict = {}


class RecipeTypeError(TypeError, ValueError):
    """A recipe, or one of its fields, of the wrong type (a ValueError too, the package's error for bad arguments)."""


def _matches(value, hint) -> bool:
    """Whether value has the annotated type: bool only for bool, int excludes bool, float takes int too."""
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    origin = typing.get_origin(hint) or hint
    return not isinstance(origin, type) or isinstance(value, origin)


def _describe(hint) -> str:
    """What a value of the annotated type is, for error messages."""
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {typing.get_args(hint)}"
    return f"of type {getattr(hint, '__name__', hint)}"


@functools.cache
def _field_types(cls) -> dict:
    """The annotated type of each field of the dataclass cls (resolved once)."""
    return typing.get_type_hints(cls)


def _canonical(value) -> str:
    """A text for value that is the same on every process (dict entries sorted)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__ + _canonical(dataclasses.asdict(value))
    return repr(value)


def check_field(name: str, value) -> None:
    """Raise RecipeTypeError unless `name` is an NVFP4Recipe field and `value` has its annotated type (the checks
    that need no other field; NVFP4Recipe's constructor does the rest)."""
    hints = _field_types(NVFP4Recipe)
    if name not in hints:
        raise RecipeTypeError(f"{name!r} is not an NVFP4Recipe field; the fields are "
                              f"{', '.join(field.name for field in dataclasses.fields(NVFP4Recipe))}")
    if not _matches(value, hints[name]):
        raise RecipeTypeError(f"{name}={value!r} ({type(value).__name__}): must be {_describe(hints[name])}")


def check_recipe(recipe, name: str = "recipe") -> None:
    """Raise RecipeTypeError unless `recipe` is an NVFP4Recipe or None (a dict of fields is not accepted)."""
    if recipe is None or isinstance(recipe, NVFP4Recipe):
        return
    hint = f"; build one with NVFP4Recipe(**{name})" if isinstance(recipe, dict) else ""
    raise RecipeTypeError(f"{name}={recipe!r} ({type(recipe).__name__}): must be an NVFP4Recipe or None{hint}")


@dataclasses.dataclass(frozen=True)
class NVFP4Recipe:
    """How a layer quantizes. Defaults follow NVIDIA's NVFP4 training recipe.

    rht: random Hadamard transform on the wgrad operands (docs/numerics.md §5).
    rht_random_sign: H = diag(s) H16 / 4 (True) or plain H16 / 4.
    stochastic_rounding: SR on output gradients (docs/numerics.md §7).
    weight_2d: 16x16 block scales for weights (docs/numerics.md §4).
    row_scaled_activation: one amax per activation row (docs/numerics.md §6), and one per column for the
      activation's columnwise (wgrad) copy (§6b).
    bf16_first_layers / bf16_last_layers: transformer layers kept in BF16.
    gemm_backend: auto | cublaslt | emulated | reference (docs/numerics.md §8).
    overlap: pipeline TP communication with the GEMMs (parallel layers only).
    overlap_min_chunk_gflops: with overlap, a layer pipelines only where each ring step's GEMM has at least this
      many GFLOP (2 * rows * out * in of one chunk); smaller ones take the plain path, as each ring step costs
      host time that small GEMMs cannot hide (docs/performance.md says where overlap pays).
    overlap_measure_links: with overlap, also measure the group's links once (ring vs collective transfer time,
      GEMM rate) and pipeline only layers whose rings are expected to beat the plain path (docs/slow_links.md);
      False: the GEMM-size floor alone decides.
    overlap_transport: ring | collectives | auto, the pipelined path overlap takes: the ring (point-to-point
      transfers, or copy engines on NVLink), split collectives (the plain path's collectives cut into row pieces,
      which keep NCCL's collective speed where its point-to-point transfers are slow: PCIe, across nodes), or
      whichever of the two the measured links favour (auto, the default; the ring where it runs on copy engines,
      or without overlap_measure_links). docs/slow_links.md says how each is chosen.
    nvfp4_4over6: 4over6 adaptive block scaling (docs/numerics.md §12) for none | weights | activations | all;
      activations are the forward inputs, never the gradients (which keep the RHT and SR), as in Transformer
      Engine's NVFP4BlockScaling. Not with the RHT on activations (rht=False for activations or all).
    nvfp4_4over6_e4m3_use_256: which 4over6 tensors take 256 as the global-scale bound (else 448).
    nvfp4_4over6_err_mode: MAE | MSE, the error that picks each block's candidate.
    nvfp4_4over6_err_use_fast_math: measure that error in the scaled domain (docs/numerics.md §12.4).
    fused_producers: layers whose input comes from a norm or an activation (nvfp4_dist.layernorm_linear, the
      parallel layers and Megatron specs built on them) quantize it in the producer's passes without writing it
      (nvfp4_dist/fused.py); the copies are the same bytes either way, so this changes speed only. On by
      default (NVFP4_DISABLE_FUSED_PRODUCERS=1 turns it off): on H100 GELU and RMSNorm are faster fused, SwiGLU
      and LayerNorm with both copies about even (docs/fused_producers.md).
    backward_mode: the operands of the dgrad and wgrad GEMMs (docs/numerics.md §10). default: NVFP4 as in §3-7;
      high_precision: the input and weight as given (forward saves the input; the weight in the compute dtype) and
      the unquantized output gradient, GEMMs in the compute dtype; dequantized: the NVFP4 copies fprop used (the
      rowwise copies of input and weight), dequantized to the compute dtype, and the unquantized output gradient.
      rht, rht_random_sign and stochastic_rounding shape the NVFP4 backward only.
    moe_dispatch: bf16 | nvfp4, what an MoE layer's expert-parallel all-to-all sends (parallel/moe_dispatch.py):
      the tokens in their dtype, or each token quantized once to NVFP4 with its own amax (row-scaled,
      docs/numerics.md §6), whose codes feed the experts' fc1 directly (docs/numerics.md §13); the combine stays in
      the tokens' dtype. Not with 4over6 on activations (row-scaled copies take no 4over6).
    check_finite: reject a non-finite amax with NonFiniteAmaxError (docs/numerics.md §2); on CUDA without a host sync, raised
      by a later quantize or by nvfp4_dist.raise_pending_nonfinite() (nvfp4_dist/finite_check.py).
    Every field must have its annotated type (rht=True, not rht="False"): RecipeTypeError names the field otherwise.
    """

    rht: bool = True
    rht_random_sign: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    row_scaled_activation: bool = False
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    gemm_backend: str = "auto"
    overlap: bool = False
    overlap_min_chunk_gflops: int = 256
    overlap_measure_links: bool = True
    overlap_transport: typing.Literal[OVERLAP_TRANSPORTS] = "auto"
    fused_producers: bool = True
    check_finite: bool = True
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    nvfp4_4over6_err_use_fast_math: bool = False
    backward_mode: typing.Literal[BACKWARD_MODES] = "default"
    moe_dispatch: typing.Literal[MOE_DISPATCH_DTYPES] = "bf16"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            check_field(field.name, getattr(self, field.name))
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend={self.gemm_backend!r} is not one of {GEMM_BACKENDS}")
        for name in ("bf16_first_layers", "bf16_last_layers", "overlap_min_chunk_gflops"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, name) not in FOUR_OVER_SIX_SCOPES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {FOUR_OVER_SIX_SCOPES}")
        if self.nvfp4_4over6_err_mode not in FOUR_OVER_SIX_ERR_MODES:
            raise ValueError(f"nvfp4_4over6_err_mode={self.nvfp4_4over6_err_mode!r} is not one of "
                             f"{FOUR_OVER_SIX_ERR_MODES}")
        if not isinstance(self.nvfp4_4over6_err_use_fast_math, bool):
            raise ValueError(f"nvfp4_4over6_err_use_fast_math={self.nvfp4_4over6_err_use_fast_math!r}: must be a bool")
        if self.nvfp4_4over6 in ("activations", "all") and self.rht:
            raise ValueError(
                f"nvfp4_4over6={self.nvfp4_4over6!r} cannot be combined with rht=True: 4over6 is not combined with "
                "the RHT of the activations' columnwise copy (docs/numerics.md §12); set rht=False "
                "(or NVFP4_DISABLE_RHT=1), or nvfp4_4over6='weights'")
        if self.moe_dispatch == "nvfp4" and self.nvfp4_4over6 in ("activations", "all"):
            raise ValueError(
                f"moe_dispatch='nvfp4' cannot be combined with nvfp4_4over6={self.nvfp4_4over6!r}: dispatched tokens "
                "are row-scaled, which takes no 4over6 (docs/numerics.md §6, §13); set nvfp4_4over6='weights' or "
                "'none', or moe_dispatch='bf16'")
        if self.nvfp4_4over6 in ("activations", "all") and self.row_scaled_activation:
            raise ValueError(
                f"nvfp4_4over6={self.nvfp4_4over6!r} cannot be combined with row_scaled_activation=True: the "
                "columnwise (wgrad) copy of a row-scaled activation takes no 4over6 (docs/numerics.md §6); set "
                "nvfp4_4over6='weights' or 'none'")

    @classmethod
    def from_env(cls, **overrides) -> "NVFP4Recipe":
        """Defaults, then the NVFP4_* environment variables (nvfp4_dist.environment), then explicit keyword overrides.

        The variables are read at every call (a change takes effect at the next one); the recipe built from the same
        settings and overrides is reused, since layers without a recipe of their own call this at every forward."""
        try:
            key = (cls, environment.raw_values(_RECIPE_NAMES),
                   tuple(sorted(overrides.items())))
            hash(key)
        except TypeError:  # an unhashable override: build it (and let the constructor say what is wrong)
            key = None
        cached = _FROM_ENV_RECIPES.get(key) if key is not None else None
        if cached is not None:
            return cached
        recipe = cls._build_from_env(overrides)
        if key is not None:
            if len(_FROM_ENV_RECIPES) >= 64:
                _FROM_ENV_RECIPES.clear()
            _FROM_ENV_RECIPES[key] = recipe
        return recipe

    @classmethod
    def _build_from_env(cls, overrides: dict) -> "NVFP4Recipe":
        values = {}
        for variable, field, value in _FLAG_OVERRIDES:
            if variable.read():
                values[field] = value
        for variable, field in _VALUE_OVERRIDES:
            setting = variable.read()
            if setting is not None:
                values[field] = setting
        values.update(overrides)
        return cls(**values)

    def fingerprint(self) -> int:
        """A signed 64-bit hash of every field, equal on every process for equal recipes (to compare ranks)."""
        text = ";".join(f"{field.name}={_canonical(getattr(self, field.name))}" for field in dataclasses.fields(self))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)

    def replace(self, **changes) -> "NVFP4Recipe":
        return dataclasses.replace(self, **changes)

    def is_bf16_layer(self, layer_number: int, num_layers: int) -> bool:
        """True when 0-based `layer_number` of `num_layers` stays in BF16."""
        return layer_number < self.bf16_first_layers or layer_number >= num_layers - self.bf16_last_layers
