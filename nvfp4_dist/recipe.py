"""NVFP4Recipe: every option of docs/numerics.md section 10, with environment overrides."""
import dataclasses

from nvfp4_dist import environment
from nvfp4_dist.environment import GEMM_BACKENDS

# Flag variable -> (field, value it sets when the variable is 1).
_FLAG_OVERRIDES = (
    (environment.DISABLE_RHT, "rht", False),
    (environment.DISABLE_SR, "stochastic_rounding", False),
    (environment.DISABLE_2D, "weight_2d", False),
    (environment.ROW_SCALED_ACTIVATION, "row_scaled_activation", True),
    (environment.RHT_NO_RANDOM_SIGN, "rht_random_sign", False),
    (environment.OVERLAP, "overlap", True),
    (environment.DISABLE_FUSED_PRODUCERS, "fused_producers", False),
)
# Variable -> the field it sets when given.
_VALUE_OVERRIDES = (
    (environment.BF16_FIRST_LAYERS, "bf16_first_layers"),
    (environment.BF16_LAST_LAYERS, "bf16_last_layers"),
    (environment.OVERLAP_MIN_CHUNK_GFLOPS, "overlap_min_chunk_gflops"),
    (environment.GEMM_BACKEND, "gemm_backend"),
)


@dataclasses.dataclass(frozen=True)
class NVFP4Recipe:
    """How a layer quantizes. Defaults follow NVIDIA's NVFP4 training recipe.

    rht: random Hadamard transform on the wgrad operands (docs/numerics.md §5).
    rht_random_sign: H = diag(s) H16 / 4 (True) or plain H16 / 4.
    stochastic_rounding: SR on output gradients (docs/numerics.md §7).
    weight_2d: 16x16 block scales for weights (docs/numerics.md §4).
    row_scaled_activation: one amax per activation row, forward only (docs/numerics.md §6).
    bf16_first_layers / bf16_last_layers: transformer layers kept in BF16.
    gemm_backend: auto | cublaslt | emulated | reference (docs/numerics.md §8).
    overlap: pipeline TP communication with the GEMMs (parallel layers only).
    overlap_min_chunk_gflops: with overlap, a layer pipelines only where each ring step's GEMM has at least this
      many GFLOP (2 * rows * out * in of one chunk); smaller ones take the plain path, as each ring step costs
      host time that small GEMMs cannot hide (docs/performance.md says where overlap pays).
    fused_producers: layers whose input comes from a norm or an activation (nvfp4_dist.layernorm_linear, the
      parallel layers and Megatron specs built on them) quantize it in the producer's passes without writing it
      (nvfp4_dist/fused.py); the copies are the same bytes either way, so this changes speed only.
    check_finite: reject a non-finite amax with NonFiniteAmaxError (docs/numerics.md §2); on CUDA without a host sync, raised
      by a later quantize or by nvfp4_dist.raise_pending_nonfinite() (nvfp4_dist/finite_check.py).
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
    fused_producers: bool = True
    check_finite: bool = True

    def __post_init__(self):
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend={self.gemm_backend!r} is not one of {GEMM_BACKENDS}")
        for name in ("bf16_first_layers", "bf16_last_layers", "overlap_min_chunk_gflops"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        if self.row_scaled_activation and self.rht:
            raise ValueError(
                "row_scaled_activation=True cannot be combined with rht=True: row-scaled "
                "activations run backward in BF16 (docs/numerics.md §6); set rht=False (or NVFP4_DISABLE_RHT=1)")
        if self.row_scaled_activation and self.stochastic_rounding:
            raise ValueError(
                "row_scaled_activation=True cannot be combined with stochastic_rounding=True: "
                "row-scaled layers keep gradients in BF16 (docs/numerics.md §6); set stochastic_rounding=False "
                "(or NVFP4_DISABLE_SR=1)")

    @classmethod
    def from_env(cls, **overrides) -> "NVFP4Recipe":
        """Defaults, then the NVFP4_* environment variables (nvfp4_dist.environment), then explicit keyword overrides."""
        values = {}
        for variable, field, value in _FLAG_OVERRIDES:
            if variable.read():
                values[field] = value
        for variable, field in _VALUE_OVERRIDES:
            setting = variable.read()
            if setting is not None:
                values[field] = setting
        values.update(overrides)
        # Row-scaled activations imply the BF16 backward, so drop the defaults that conflict.
        if values.get("row_scaled_activation"):
            values.setdefault("rht", False)
            values.setdefault("stochastic_rounding", False)
        return cls(**values)

    def replace(self, **changes) -> "NVFP4Recipe":
        return dataclasses.replace(self, **changes)

    def is_bf16_layer(self, layer_number: int, num_layers: int) -> bool:
        """True when 0-based `layer_number` of `num_layers` stays in BF16."""
        return layer_number < self.bf16_first_layers or layer_number >= num_layers - self.bf16_last_layers
