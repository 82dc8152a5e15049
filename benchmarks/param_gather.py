"""Bytes moved by FSDP2's parameter all-gather per training step: weights gathered in NVFP4 vs in BF16, same model.

A GPT-shaped stack (per layer: two LayerNorms and the QKV, projection, fc1 and fc2 NVFP4 linears with biases), each
layer and the whole model under torch.distributed.fsdp.fully_shard with BF16 parameters for compute
(MixedPrecisionPolicy(param_dtype=torch.bfloat16)), trained on DP gloo processes in two runs:
  bf16:  FSDP2's own gather (BF16 weights; each layer quantizes its gathered weight),
  nvfp4: enable_nvfp4_param_gather (nvfp4_dist.parallel.fsdp): the NVFP4 linears' weights gathered in NVFP4.
Every tensor FSDP2 hands to the all-gather (torch.distributed.all_gather_single) is counted, in forward and in
backward's re-gather, per rank and step; norms and biases travel in BF16 in both runs. A byte count does not depend
on the device or the transport, so this CPU run gives the numbers a GPU run would; no time is measured.
Target: nvfp4 bytes <= 0.30x bf16 bytes. Also counted: the amax all-reduces per step (one, after the optimizer
step, for every weight), and the same ratio with 1x16 weight blocks (both copies travel).

--megatron adds Megatron-Core's distributed optimizer: the same stack built from NVFP4ColumnParallelLinear /
NVFP4RowParallelLinear (TP=1; BF16 torch LayerNorms) inside Megatron's DistributedDataParallel
(use_distributed_optimizer=True) with Megatron's optimizer, trained without and with
nvfp4_dist.parallel.megatron.enable_nvfp4_param_gather (16x16 weight blocks); every tensor handed to an all-gather
in the last step (Megatron's bucket groups' dist.all_gather_into_tensor, the NVFP4 gather's single all-gather) is
counted per rank and recorded under "megatron".

    python benchmarks/param_gather.py [--hidden 1024] [--layers 2] [--dp 2] [--steps 2] [--megatron] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import nvfp4_dist as nv
from nvfp4_dist import sharded_weight
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel import fsdp as nvfp4_fsdp
from gloo_ranks import run_on_gloo_ranks  # noqa: E402 (benchmarks/ is on sys.path when run)
from megatron_on_cpu import CpuForCuda, init_megatron  # noqa: E402
from provenance import REPOSITORY_ROOT, command_line, git_commit  # noqa: E402

TARGET_RATIO = 0.30
TOKENS = 32


class Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = nv.Linear(hidden, 3 * hidden), nv.Linear(hidden, hidden)
        self.fc1, self.fc2 = nv.Linear(hidden, 4 * hidden), nv.Linear(4 * hidden, hidden)

    def forward(self, x):
        hidden = x.shape[-1]
        x = x + self.proj(self.qkv(self.norm1(x))[..., :hidden])
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class Counter:
    """Bytes handed to dist.all_gather_single and calls of the amax all-reduce, while active."""

    def __init__(self):
        self.gathered = self.amax_reductions = 0

    def __enter__(self):
        self.gather, self.reduce = dist.all_gather_single, collectives.all_reduce_amax

        def gather(output, input, *args, **kwargs):
            self.gathered += input.numel() * input.element_size()
            return self.gather(output, input, *args, **kwargs)

        def reduce(*args, **kwargs):
            self.amax_reductions += 1
            return self.reduce(*args, **kwargs)
        dist.all_gather_single, collectives.all_reduce_amax = gather, reduce
        return self

    def __exit__(self, *exc):
        dist.all_gather_single, collectives.all_reduce_amax = self.gather, self.reduce


def run(mode: str, recipe: nv.NVFP4Recipe, args, rank: int, world_size: int) -> dict:
    """Bytes all-gathered per rank in the last step, and the amax all-reduces of that step, in one mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)])
    mesh = init_device_mesh("cpu", (world_size,))
    if mode == "nvfp4":
        nvfp4_fsdp.enable_nvfp4_param_gather(model, world_size)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    for _ in range(args.steps):
        with Counter() as counter:
            with nv.autocast(recipe):
                model(torch.randn(TOKENS, args.hidden)).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if mode == "nvfp4":
                nvfp4_fsdp.precompute_weight_amaxes(model)
    weights = [module.weight for _, module in nvfp4_fsdp.nvfp4_layers(model)]
    shapes = [(w.shape[0] // world_size, w.shape[1]) for w in weights]
    return {"gathered_bytes_per_rank": counter.gathered, "amax_allreduces": counter.amax_reductions,
            "nvfp4_weight_wire_bytes": sum(sharded_weight.wire_bytes(s, recipe) for s in shapes),
            "bf16_weight_bytes": sum(2 * s[0] * s[1] for s in shapes)}


class GatherCounter:
    """Bytes handed to any all-gather of a whole tensor while active: dist.all_gather_into_tensor and
    dist.all_gather_single, Megatron's bucket groups' module-level copy of the former (dist_all_gather_func in
    megatron.core.distributed.param_and_grad_buffer, called by _ParamAndGradBucketGroup.start_param_sync) and the
    collectives module's copy of the latter (the NVFP4 gather's)."""

    def __init__(self):
        self.gathered = 0

    def _wrap(self, fn):
        def gather(output, input, *args, **kwargs):
            self.gathered += input.numel() * input.element_size()
            return fn(output, input, *args, **kwargs)
        return gather

    def __enter__(self):
        self.saved = [(dist, "all_gather_into_tensor"), (collectives, "_all_gather_single")]
        if hasattr(dist, "all_gather_single"):
            self.saved.append((dist, "all_gather_single"))
        from megatron.core.distributed import param_and_grad_buffer
        self.saved.append((param_and_grad_buffer, "dist_all_gather_func"))
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.saved]
        for owner, name, fn in self.saved:
            setattr(owner, name, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


def _megatron_stack(config, hidden: int, layers: int, recipe):
    from megatron.core.transformer.module import MegatronModule
    from nvfp4_dist.parallel.megatron import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear

    def column(rows, cols):
        return NVFP4ColumnParallelLinear(cols, rows, config=config, init_method=config.init_method, bias=True,
                                         gather_output=False, recipe=recipe)

    class MegatronBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(hidden, dtype=torch.bfloat16)
            self.norm2 = torch.nn.LayerNorm(hidden, dtype=torch.bfloat16)
            self.qkv, self.proj = column(3 * hidden, hidden), column(hidden, hidden)
            self.fc1 = column(4 * hidden, hidden)
            self.fc2 = NVFP4RowParallelLinear(4 * hidden, hidden, config=config, init_method=config.init_method,
                                              bias=True, input_is_parallel=True, skip_bias_add=False, recipe=recipe)

        def forward(self, x):
            x = x + self.proj(self.qkv(self.norm1(x))[0][..., :hidden])[0]
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))[0]))[0]

    class Stack(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.blocks = torch.nn.ModuleList([MegatronBlock() for _ in range(layers)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x
    return Stack()


def run_megatron(mode: str, recipe: nv.NVFP4Recipe, args, rank: int, world_size: int) -> dict:
    """Bytes handed to the param all-gathers per rank in the last step of Megatron's distributed optimizer, with
    Megatron's own BF16 gather (mode "bf16") or enable_nvfp4_param_gather's (mode "nvfp4"). Megatron's groups must
    be initialized (init_megatron)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nvfp4_dist.parallel.megatron import enable_nvfp4_param_gather
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                               gradient_accumulation_fusion=False, init_method_std=0.02)
    torch.manual_seed(0)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=False,
                                               overlap_grad_reduce=False)
    model = DistributedDataParallel(config, ddp_config, _megatron_stack(config, args.hidden, args.layers, recipe))
    with CpuForCuda():
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=0.0,
                                                           use_distributed_optimizer=True), [model])
    handle = enable_nvfp4_param_gather([model]) if mode == "nvfp4" else None
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(args.steps):
        x = torch.randn(TOKENS, 1, args.hidden, generator=generator).to(torch.bfloat16)
        sent_before = handle.bytes_sent if handle else 0
        with GatherCounter() as counter:
            model.zero_grad_buffer()
            optimizer.zero_grad()
            with nv.autocast(recipe):
                model(x).float().square().mean().backward()
            model.finish_grad_sync()
            with CpuForCuda():
                optimizer.step()
    buckets = [bucket for group in model.bucket_groups for bucket in group.buckets]
    return {"gathered_bytes_per_rank": counter.gathered,
            "handle_bytes_sent": handle.bytes_sent - sent_before if handle else None,
            "bucket_bf16_bytes_per_rank": sum(b.param_data.numel() * b.param_data.element_size() // world_size
                                              for b in buckets)}


def megatron_worker(rank: int, world_size: int, args) -> dict:
    """Megatron's BF16 gather and the NVFP4 gather (16x16 blocks), every rank's counts (on a gloo rank)."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    init_megatron()
    recipe = nv.NVFP4Recipe()
    mine = {mode: run_megatron(mode, recipe, args, rank, world_size) for mode in ("bf16", "nvfp4")}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def megatron_record(per_rank: list) -> dict:
    """The "megatron" entry of the JSON from every rank's counts."""
    bf16 = [counts["bf16"]["gathered_bytes_per_rank"] for counts in per_rank]
    nvfp4 = [counts["nvfp4"]["gathered_bytes_per_rank"] for counts in per_rank]
    return {"gather": "Megatron-Core DistributedDataParallel(use_distributed_optimizer=True), TP=1, "
                      "overlap_param_gather=False; NVFP4: enable_nvfp4_param_gather",
            "weight_blocks": "16x16", "bf16_bytes": max(bf16), "nvfp4_bytes": max(nvfp4),
            "ratio": max(n / b for n, b in zip(nvfp4, bf16)), "target": TARGET_RATIO,
            "per_rank": [{"rank": rank, "bf16_bytes": b, "nvfp4_bytes": n, "ratio": n / b,
                          "nvfp4_bytes_sent": counts["nvfp4"]["handle_bytes_sent"],
                          "bf16_bucket_bytes": counts["bf16"]["bucket_bf16_bytes_per_rank"]}
                         for rank, (counts, b, n) in enumerate(zip(per_rank, bf16, nvfp4))]}


def worker(rank: int, world_size: int, args) -> dict:
    """Both gathers under both weight block shapes (on a gloo rank of gloo_ranks.run_on_gloo_ranks)."""
    results = {}
    for label, recipe in (("2d", nv.NVFP4Recipe()), ("1d", nv.NVFP4Recipe(weight_2d=False))):
        results[label] = {mode: run(mode, recipe, args, rank, world_size) for mode in ("bf16", "nvfp4")}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel gloo processes")
    parser.add_argument("--steps", type=int, default=2, help="steps run; the last one is counted")
    parser.add_argument("--megatron", action="store_true",
                        help="also count Megatron-Core's distributed optimizer's param all-gather")
    parser.add_argument("--out", type=pathlib.Path,
                        default=REPOSITORY_ROOT / "benchmarks" / "results" / "param_gather_cpu.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the counted step follows an optimizer step)")
    sharded_weight.check_weight_sharding((args.hidden, args.hidden), args.dp, name="--hidden x --hidden weight")
    results = run_on_gloo_ranks(worker, args.dp, args)
    rows = []
    for label, runs in results.items():
        bf16, nvfp4 = runs["bf16"]["gathered_bytes_per_rank"], runs["nvfp4"]["gathered_bytes_per_rank"]
        row = {"weight_blocks": "16x16" if label == "2d" else "1x16", "bf16_bytes_per_rank": bf16,
               "nvfp4_bytes_per_rank": nvfp4, "ratio": nvfp4 / bf16,
               "weights_only_ratio": runs["nvfp4"]["nvfp4_weight_wire_bytes"] / runs["nvfp4"]["bf16_weight_bytes"],
               "amax_allreduces_per_step": runs["nvfp4"]["amax_allreduces"],
               "target": TARGET_RATIO if label == "2d" else None}
        rows.append(row)
        print(f"{row['weight_blocks']:>5} blocks: BF16 gather {bf16 / 2**20:8.3f} MiB/rank/step, NVFP4 gather "
              f"{nvfp4 / 2**20:8.3f} MiB/rank/step: {row['ratio']:.4f}x (weights alone "
              f"{row['weights_only_ratio']:.4f}x), amax all-reduces per step {row['amax_allreduces_per_step']}"
              + (f", target <= {TARGET_RATIO}" if row["target"] else ""))
    record = {"benchmark": "param_gather", "device": "cpu (gloo)", "device_independent": True,
              "world_size": args.dp, "hidden": args.hidden, "layers": args.layers, "tokens": TOKENS,
              "parameter_dtype": "bfloat16", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "commit": git_commit()[:7], "torch": torch.__version__, "command": command_line(), "results": rows}
    if args.megatron:
        megatron = megatron_record(run_on_gloo_ranks(megatron_worker, args.dp, args))
        record["megatron"] = megatron
        print(f"Megatron distributed optimizer, 16x16 blocks: BF16 gather {megatron['bf16_bytes'] / 2**20:8.3f} "
              f"MiB/rank/step, NVFP4 gather {megatron['nvfp4_bytes'] / 2**20:8.3f} MiB/rank/step: "
              f"{megatron['ratio']:.4f}x, target <= {TARGET_RATIO}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
