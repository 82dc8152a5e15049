"""The recipe variants of the convergence tables (tests_multigpu/gpt_convergence.py, megatron_convergence.py).

Each variant changes the default NVFP4 recipe in one respect and trains on the same seed and data; the tables compare
its final loss with BF16's and with its baseline's, the variant it differs from in that one respect: 4over6 on the
activations needs the RHT off (docs/numerics.md §12), so those variants compare with the default recipe without the
RHT; the row-scaled recipe's NVFP4 backward (its per-column scaled wgrad copy, docs/numerics.md §6b) compares with its
BF16 backward (backward_mode dequantized: dgrad and wgrad on the forward's copies dequantized, docs/numerics.md §10).
"""
from __future__ import annotations

import dataclasses
import datetime

from tests.helpers.benchmarks import load_benchmark_module


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    description: str
    fields: dict | None  # NVFP4Recipe fields that differ from the defaults; None: every linear in BF16
    baseline: str | None  # the variant this one is compared with besides BF16


VARIANTS = (
    Variant("bf16", "BF16 (every linear unquantized)", None, None),
    Variant("nvfp4", "NVFP4, default recipe", {}, "bf16"),
    Variant("nvfp4_no_rht", "NVFP4, RHT off", {"rht": False}, "nvfp4"),
    Variant("4over6_weights", "4over6 on the weights", {"nvfp4_4over6": "weights"}, "nvfp4"),
    Variant("4over6_activations", "4over6 on the activations, RHT off",
            {"nvfp4_4over6": "activations", "rht": False}, "nvfp4_no_rht"),
    Variant("4over6_all", "4over6 on weights and activations, RHT off", {"nvfp4_4over6": "all", "rht": False},
            "nvfp4_no_rht"),
    Variant("row_scaled_bf16_backward", "row-scaled activations, BF16 backward",
            {"row_scaled_activation": True, "backward_mode": "dequantized"}, "nvfp4"),
    Variant("row_scaled", "row-scaled activations, NVFP4 backward", {"row_scaled_activation": True},
            "row_scaled_bf16_backward"),
)
BY_NAME = {variant.name: variant for variant in VARIANTS}
NAMES = tuple(BY_NAME)
FINAL_WINDOW = 10  # the final loss is the mean of the last 10 steps' losses


def select(names) -> list[Variant]:
    """The variants named, with the baselines they are compared with (and theirs), in VARIANTS order."""
    unknown = [name for name in names if name not in BY_NAME]
    if unknown:
        raise ValueError(f"variants {unknown}: unknown; the variants are {', '.join(NAMES)}")
    wanted = set()
    for name in names:
        while name is not None and name not in wanted:
            wanted.add(name)
            name = BY_NAME[name].baseline
    return [variant for variant in VARIANTS if variant.name in wanted]


def train_flags(variant: Variant) -> list[str]:
    """The recipe flags of megatron_train.py and nvfp4-train that make the variant's recipe (not for bf16)."""
    flags = []
    for field, value in variant.fields.items():
        if (field, value) == ("rht", False):
            flags.append("--no-rht")
        elif (field, value) == ("row_scaled_activation", True):
            flags.append("--row-scaled-activation")
        elif field in ("nvfp4_4over6", "backward_mode"):
            flags += ["--" + field.replace("_", "-"), value]
        else:
            raise ValueError(f"variant {variant.name}: no flag sets {field}={value!r}")
    return flags


def final_loss(losses: list[float]) -> float:
    tail = losses[-FINAL_WINDOW:]
    return sum(tail) / len(tail)


def entry(variant: Variant, losses: list[float], seconds: float, **extra) -> dict:
    """One variant's record: what it is, its final (mean of the last 10 steps) and first loss, its time, its losses."""
    return dict(description=variant.description, recipe=variant.fields, baseline=variant.baseline,
                final_loss=final_loss(losses), first_loss=losses[0], seconds=seconds, **extra, losses=losses)


def add_gaps(results: dict) -> dict:
    """Each entry's gap_vs_bf16 and gap_vs_baseline: (final loss - theirs) / theirs (None without them)."""
    def gap(name, other):
        if other is None or other not in results:
            return None
        return (results[name]["final_loss"] - results[other]["final_loss"]) / results[other]["final_loss"]
    for name, record in results.items():
        record["gap_vs_bf16"] = gap(name, "bf16") if name != "bf16" else None
        record["gap_vs_baseline"] = gap(name, record["baseline"])
    return results


def summary_lines(results: dict) -> list[str]:
    lines = [f"{'variant':<26} {'final loss':>10} {'vs bf16':>8} {'baseline':<26} {'vs base':>8} {'seconds':>8}"]
    for name, record in results.items():
        percent = [f"{100 * g:+.2f}%" if g is not None else "-" for g in (record["gap_vs_bf16"],
                                                                          record["gap_vs_baseline"])]
        lines.append(f"{name:<26} {record['final_loss']:>10.4f} {percent[0]:>8} {record['baseline'] or '-':<26} "
                     f"{percent[1]:>8} {record['seconds']:>8.1f}")
    return lines


def gpu_suffix(device_name: str, gpus: int = 1) -> str:
    """The GPU-kind part of a result's file name, as benchmarks/ names theirs (torchrun_setup.gpu_label:
    "NVIDIA H100 80GB HBM3" -> h100), with the GPU count when there are several."""
    kind = load_benchmark_module("torchrun_setup").gpu_label(device_name)
    return kind if gpus == 1 else f"{kind}x{gpus}"


def provenance() -> dict:
    """The commit (benchmarks/provenance.py) and the date, for the result JSON."""
    commit = load_benchmark_module("provenance").git_commit()
    return dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat())
