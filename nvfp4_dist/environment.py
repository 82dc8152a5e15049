"""The NVFP4_* environment variables: each one's name, meaning and allowed values, and the one place that reads them.

Every variable is read when it is needed (not at import), so a change to os.environ takes effect at the next
call. An unset or empty variable means its default; any other value outside the allowed ones raises a
ValueError naming the variable, the value and what is allowed.

The layers read several variables at every call, so reads go through `raw_values`: os.environ's own mapping,
looked up with pre-encoded keys (os.environ.get encodes the name and decodes the value at each read, which
costs far more than the lookup), and a parsed value is kept per variable for the text it was parsed from.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

GEMM_BACKENDS = ("auto", "cublaslt", "emulated", "reference")
FOUR_OVER_SIX_SCOPES = ("none", "weights", "activations", "all")
FOUR_OVER_SIX_ERR_MODES = ("MAE", "MSE")
BACKWARD_MODES = ("default", "high_precision", "dequantized")
HOPPER_GEMM_PATHS = ("fused", "dequantize")
OVERLAP_TRANSPORTS = ("auto", "ring", "collectives")
SYMMETRIC_MEMORY_SWITCHES = ("auto", "1", "on", "0", "off")
MOE_DISPATCH_DTYPES = ("bf16", "nvfp4")


_MISSING = object()
_PARSED: dict = {}  # (name, raw text) -> parsed value
_ENVIRON = os.environ
_ENVIRON_DATA = getattr(os.environ, "_data", None)  # CPython's mapping behind os.environ (encoded keys and values)
_ENCODED_NAMES: dict = {}


def raw_values(names: tuple) -> tuple:
    """The value of each named variable as os.environ holds it, None when unset: encoded (bytes on POSIX) where
    os.environ keeps an encoded mapping, else the text. Equal tuples mean equal settings (a cache key)."""
    if _ENVIRON_DATA is None or os.environ is not _ENVIRON:  # no encoded mapping, or os.environ was replaced
        return tuple(os.environ.get(name) for name in names)
    try:
        keys = _ENCODED_NAMES[names]
    except KeyError:
        keys = _ENCODED_NAMES[names] = tuple(os.environ.encodekey(name) for name in names)
    return tuple(map(_ENVIRON_DATA.get, keys))


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: `parse` turns its text into a value; unset or empty gives `default`."""

    name: str
    meaning: str
    allowed: str
    parse: Callable[["Variable", str], Any]
    default: Any = None

    def read(self) -> Any:
        raw = raw_values((self.name,))[0]
        if not raw:
            return self.default
        parsed = _PARSED.get((self.name, raw), _MISSING)
        if parsed is _MISSING:
            parsed = self.parse(self, raw.decode() if isinstance(raw, bytes) else raw)  # may raise: not kept
            if len(_PARSED) >= 256:
                _PARSED.clear()
            _PARSED[(self.name, raw)] = parsed
        return parsed

    def reject(self, text: str):
        raise ValueError(f"environment variable {self.name}={text!r}: allowed values are {self.allowed}")


def _flag(variable: Variable, text: str) -> bool:
    if text not in ("0", "1"):
        variable.reject(text)
    return text == "1"


def _count(variable: Variable, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        variable.reject(text)
    return value


def _choice(choices: tuple) -> Callable[[Variable, str], str]:
    def parse(variable: Variable, text: str) -> str:
        if text not in choices:
            variable.reject(text)
        return text
    return parse


def _upper_choice(choices: tuple) -> Callable[[Variable, str], str]:
    def parse(variable: Variable, text: str) -> str:
        if text.upper() not in choices:
            variable.reject(text)
        return text.upper()
    return parse


def _symmetric_switch(variable: Variable, text: str) -> bool:
    """True unless the switch turns symmetric memory off (auto, 1 and on all let the group decide)."""
    switch = text.strip().lower()
    if switch not in SYMMETRIC_MEMORY_SWITCHES:
        variable.reject(text)
    return switch not in ("0", "off")


def _path(variable: Variable, text: str) -> str:
    return text


FLAG = "0 or 1"
COUNT = "an integer >= 0"

# Recipe overrides, applied by NVFP4Recipe.from_env() (docs/numerics.md §10).
DISABLE_RHT = Variable("NVFP4_DISABLE_RHT", "1: recipe rht=False (no random Hadamard transform on wgrad operands)",
                       FLAG, _flag, False)
DISABLE_SR = Variable("NVFP4_DISABLE_SR", "1: recipe stochastic_rounding=False (round-to-nearest gradients)",
                      FLAG, _flag, False)
DISABLE_2D = Variable("NVFP4_DISABLE_2D", "1: recipe weight_2d=False (1x16 instead of 16x16 weight blocks)",
                      FLAG, _flag, False)
ROW_SCALED_ACTIVATION = Variable("NVFP4_ROW_SCALED_ACTIVATION",
                                 "1: recipe row_scaled_activation=True (one amax per activation row; per column for "
                                 "its wgrad copy)",
                                 FLAG, _flag, False)
RHT_NO_RANDOM_SIGN = Variable("NVFP4_RHT_NO_RANDOM_SIGN", "1: recipe rht_random_sign=False (plain H16 / 4)",
                              FLAG, _flag, False)
BF16_FIRST_LAYERS = Variable("NVFP4_BF16_FIRST_LAYERS", "recipe bf16_first_layers: leading transformer layers kept "
                             "in BF16", COUNT, _count)
BF16_LAST_LAYERS = Variable("NVFP4_BF16_LAST_LAYERS", "recipe bf16_last_layers: trailing transformer layers kept "
                            "in BF16", COUNT, _count)
DISABLE_FUSED_PRODUCERS = Variable("NVFP4_DISABLE_FUSED_PRODUCERS", "1: recipe fused_producers=False (norms and "
                                   "activations write their output for the linear's cast)", FLAG, _flag, False)
OVERLAP = Variable("NVFP4_OVERLAP", "1: recipe overlap=True (pipeline tensor-parallel communication with the GEMMs)",
                   FLAG, _flag, False)
OVERLAP_MIN_CHUNK_GFLOPS = Variable("NVFP4_OVERLAP_MIN_CHUNK_GFLOPS", "recipe overlap_min_chunk_gflops: the "
                                    "smallest ring-step GEMM (GFLOP) that overlap pipelines", COUNT, _count)
OVERLAP_TRANSPORT = Variable("NVFP4_OVERLAP_TRANSPORT", "recipe overlap_transport: the pipelined path overlap takes "
                             "(ring, split collectives, or auto: whichever of the two the measured links favour)",
                             ", ".join(OVERLAP_TRANSPORTS), _choice(OVERLAP_TRANSPORTS))
OVERLAP_IGNORE_LINKS = Variable("NVFP4_OVERLAP_IGNORE_LINKS", "1: recipe overlap_measure_links=False (the overlap "
                                "choice ignores the measured link speed)", FLAG, _flag, False)
GEMM_BACKEND = Variable("NVFP4_GEMM_BACKEND", "the GEMM backend when neither the call nor the recipe names one "
                        "(and recipe gemm_backend)", ", ".join(GEMM_BACKENDS), _choice(GEMM_BACKENDS))
FOUR_OVER_SIX = Variable("NVFP4_4OVER6", "recipe nvfp4_4over6: the tensors quantized with 4over6 adaptive block "
                         "scaling (docs/numerics.md §12)", ", ".join(FOUR_OVER_SIX_SCOPES), _choice(FOUR_OVER_SIX_SCOPES))
FOUR_OVER_SIX_E4M3_USE_256 = Variable("NVFP4_4OVER6_E4M3_USE_256", "recipe nvfp4_4over6_e4m3_use_256: the 4over6 "
                                      "tensors whose global scale takes the bound 256 instead of 448",
                                      ", ".join(FOUR_OVER_SIX_SCOPES), _choice(FOUR_OVER_SIX_SCOPES))
FOUR_OVER_SIX_ERR_MODE = Variable("NVFP4_4OVER6_ERR_MODE", "recipe nvfp4_4over6_err_mode: the error that picks each "
                                  "block's 4over6 candidate", ", ".join(FOUR_OVER_SIX_ERR_MODES) + " (any case)",
                                  _upper_choice(FOUR_OVER_SIX_ERR_MODES))
FOUR_OVER_SIX_ERR_USE_FAST_MATH = Variable("NVFP4_4OVER6_ERR_USE_FAST_MATH", "1: recipe "
                                           "nvfp4_4over6_err_use_fast_math=True (the 4over6 error in the scaled "
                                           "domain)", FLAG, _flag, False)
BACKWARD_MODE = Variable("NVFP4_BACKWARD_MODE", "recipe backward_mode: the operands of the dgrad and wgrad GEMMs "
                         "(default: NVFP4; high_precision: the unquantized input and weight; dequantized: the "
                         "forward's NVFP4 copies dequantized)", ", ".join(BACKWARD_MODES), _choice(BACKWARD_MODES))
MOE_DISPATCH = Variable("NVFP4_MOE_DISPATCH", "recipe moe_dispatch: what MoE layers send to their experts' ranks "
                        "(bf16: the tokens as given; nvfp4: each token quantized once with its own amax, "
                        "docs/numerics.md §13)", ", ".join(MOE_DISPATCH_DTYPES), _choice(MOE_DISPATCH_DTYPES))

# Implementation switches.
FORCE_REFERENCE = Variable("NVFP4_FORCE_REFERENCE", "1: run the pure-torch reference instead of the CUDA kernels, "
                           "on every device", FLAG, _flag, False)
HOPPER_GEMM = Variable("NVFP4_HOPPER_GEMM", "the emulated (Hopper) GEMM's path: dequantize (BF16 operand copies "
                       "into cuBLASLt, faster) or fused (dequantization inside a Triton GEMM, less memory)",
                       ", ".join(HOPPER_GEMM_PATHS), _choice(HOPPER_GEMM_PATHS), "dequantize")
SYMMETRIC_MEMORY = Variable("NVFP4_SYMMETRIC_MEMORY", "0/off: tensor-parallel collectives never use NVLink peer "
                            "memory; auto/1/on: they do where the group allows (NCCL on one host, 2 to 8 ranks)",
                            ", ".join(SYMMETRIC_MEMORY_SWITCHES) + " (any case)", _symmetric_switch, True)
VERIFY_WEIGHT_CACHE = Variable("NVFP4_VERIFY_WEIGHT_CACHE", "1: before reusing a CUDA weight's cached NVFP4 copies, "
                                "compare the weight with its values when quantized (a host sync per layer call; CPU "
                                "weights are always compared)", FLAG, _flag, False)
CHECK_TP_CONSISTENCY = Variable("NVFP4_CHECK_TP_CONSISTENCY", "1: every call of a tensor-parallel layer compares its "
                                "configuration, recipe and input shape across the group (default: its first call "
                                "only)", FLAG, _flag, False)
BUILD_DIR = Variable("NVFP4_BUILD_DIR", "folder of the CUDA extension's build cache (default: a folder under "
                     "~/.cache/nvfp4_dist keyed by the torch and CUDA versions and the GPU targets)",
                     "a directory path", _path)

VARIABLES = (DISABLE_RHT, DISABLE_SR, DISABLE_2D, ROW_SCALED_ACTIVATION, RHT_NO_RANDOM_SIGN, DISABLE_FUSED_PRODUCERS,
             BF16_FIRST_LAYERS, BF16_LAST_LAYERS, OVERLAP, OVERLAP_MIN_CHUNK_GFLOPS, OVERLAP_TRANSPORT,
             OVERLAP_IGNORE_LINKS, GEMM_BACKEND, FOUR_OVER_SIX, FOUR_OVER_SIX_E4M3_USE_256, FOUR_OVER_SIX_ERR_MODE,
             FOUR_OVER_SIX_ERR_USE_FAST_MATH, BACKWARD_MODE, MOE_DISPATCH, FORCE_REFERENCE, HOPPER_GEMM,
             SYMMETRIC_MEMORY, VERIFY_WEIGHT_CACHE, CHECK_TP_CONSISTENCY, BUILD_DIR)
