"""NVFP4Recipe: every option of docs/numerics.md section 10, with environment overrides."""
import dataclasses
import os

GEMM_BACKENDS = ("auto", "cublaslt", "emulated", "reference")

# Environment variable -> (field, value it sets when the variable is "1").
_BOOLEAN_ENV_OVERRIDES = {
    "NVFP4_DISABLE_RHT": ("rht", False),
    "NVFP4_DISABLE_SR": ("stochastic_rounding", False),
    "NVFP4_DISABLE_2D": ("weight_2d", False),
    "NVFP4_ROW_SCALED_ACTIVATION": ("row_scaled_activation", True),
    "NVFP4_RHT_NO_RANDOM_SIGN": ("rht_random_sign", False),
}
_INTEGER_ENV_OVERRIDES = {
    "NVFP4_BF16_FIRST_LAYERS": "bf16_first_layers",
    "NVFP4_BF16_LAST_LAYERS": "bf16_last_layers",
    "NVFP4_OVERLAP_MIN_CHUNK_GFLOPS": "overlap_min_chunk_gflops",
}
_GEMM_BACKEND_ENV = "NVFP4_GEMM_BACKEND"


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
      host time that small GEMMs cannot hide (the default: measured on H200, README "When to turn overlap on").
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
        """Defaults, then environment variables, then explicit keyword overrides."""
        values = {}
        for var, (field, value) in _BOOLEAN_ENV_OVERRIDES.items():
            setting = os.environ.get(var)
            if setting is None or setting == "":
                continue
            if setting not in ("0", "1"):
                raise ValueError(f"environment variable {var}={setting!r}: allowed values are 0 and 1")
            if setting == "1":
                values[field] = value
        for var, field in _INTEGER_ENV_OVERRIDES.items():
            setting = os.environ.get(var)
            if setting:
                try:
                    values[field] = int(setting)
                except ValueError:
                    raise ValueError(f"environment variable {var}={setting!r}: must be an integer >= 0") from None
        if os.environ.get(_GEMM_BACKEND_ENV):
            values["gemm_backend"] = os.environ[_GEMM_BACKEND_ENV]
        if os.environ.get("NVFP4_OVERLAP") == "1":
            values["overlap"] = True
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
