"""The megatron-core this integration needs, and the constructor conventions all its modules follow.

Importing it without megatron-core raises an ImportError that says how to install it; a version outside
the tested range logs a warning.
"""
from __future__ import annotations

import logging

import torch

try:
    from megatron.core.package_info import __version__ as MEGATRON_CORE_VERSION
except ImportError as error:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "nvfp4_dist.parallel.megatron needs megatron-core (0.16 to 0.19): "
        "pip install nvfp4-dist[megatron]") from error

logger = logging.getLogger("nvfp4_dist")

SUPPORTED_MEGATRON_CORE = ("0.16", "0.19")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


if not (_version_tuple(SUPPORTED_MEGATRON_CORE[0]) <= _version_tuple(MEGATRON_CORE_VERSION)
        <= _version_tuple(SUPPORTED_MEGATRON_CORE[1])):
    logger.warning("megatron-core %s is outside the tested range %s to %s", MEGATRON_CORE_VERSION,
                   *SUPPORTED_MEGATRON_CORE)


def layer_device(config) -> torch.device:
    """CPU under config.use_cpu_initialization or without CUDA, else the current CUDA device."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def log_unknown_kwargs(layer: str, kwargs: dict) -> None:
    """Keywords that a newer megatron-core passes and this module does not use are accepted and logged."""
    if kwargs:
        logger.debug("%s: ignoring Megatron keyword arguments %s", layer, sorted(kwargs))
