"""MoE convergence on the CPU: a small Megatron-Core MoE GPTModel trained three ways, same seed and data, at EP=2.

  bf16            Megatron's own MoE model: its local spec (get_gpt_decoder_block_spec without Transformer Engine,
                  SDPA attention) with its MoELayer, router, alltoall dispatcher and SequentialMLP experts; no NVFP4
                  anywhere (the parameters and the arithmetic in FP32 on the CPU)
  nvfp4           the NVFP4 spec (get_gpt_decoder_block_nvfp4_spec, default recipe): NVFP4 linears, NVFP4GroupedMLP
                  experts, tokens dispatched as Megatron does (moe_dispatch="bf16")
  nvfp4_dispatch  the same with NVFP4Recipe(moe_dispatch="nvfp4"): each token quantized once before the all-to-all

Model: GPTModel of 4 layers (the first dense, three MoE: --experts experts, top --topk, a shared expert unless
--no-shared-expert), hidden --hidden, SwiGLU, a byte vocabulary (256). Each is trained on two data sources of
nvfp4_dist.launch (launch/): "fables", random windows of the bundled corpus launch/data/fables.txt, and "markov",
new text from an order-3 Markov chain of it (launch/markov_text.py: never repeated, so the loss settles near the
chain's entropy rate), each data-parallel rank reading its own stream, in Megatron's schedule
(get_forward_backward_func, --micro-batches micro-batches of --micro-batch x --seq tokens per rank and step) with
torch AdamW (betas 0.9, 0.95, weight decay 0.1, gradient clipping 1.0 on the global norm, --warmup steps of linear
warm-up then cosine decay to lr / 10), gradients reduced by Megatron's rule (non-expert parameters over the
data-parallel group, experts over the expert data-parallel group). Final loss: the mean of the last --final-window
steps' training losses; each NVFP4 run passes when |final - BF16's final| / BF16's final <= 2%, the tolerance of the
dense Megatron runs on GPUs (tests_multigpu/test_megatron_gpt.py).

    python benchmarks/moe_convergence.py [--ep 2] [--steps 250] [--sources fables markov]
Writes benchmarks/results/moe_convergence_cpu.json (--out elsewhere).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.resources
import json
import math
import pathlib
import sys
import time
import warnings

import torch
import torch.distributed as dist

from gloo_ranks import run_on_gloo_ranks  # noqa: E402 (benchmarks/ is on sys.path when run)
from megatron_on_cpu import megatron_moe_on_cpu  # noqa: E402
from provenance import REPOSITORY_ROOT, command_line, git_commit  # noqa: E402

TOLERANCE = 0.02  # the dense runs' tolerance against BF16 (tests_multigpu/test_megatron_gpt.py)
VOCAB = 256  # bytes
MARKOV_ORDER = 3
MODELS = ("bf16", "nvfp4", "nvfp4_dispatch")
DESCRIPTIONS = {"bf16": "Megatron's local MoE spec (SequentialMLP experts), unquantized",
                "nvfp4": "NVFP4 spec, NVFP4GroupedMLP experts, BF16 dispatch (moe_dispatch=\"bf16\")",
                "nvfp4_dispatch": "NVFP4 spec, NVFP4GroupedMLP experts, NVFP4 dispatch (moe_dispatch=\"nvfp4\")"}
SOURCES = ("fables", "markov")


# ---------------------------------------------------------------------------------------------------------------
# Model, data, training.

def moe_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig
    shared = None if args.no_shared_expert else args.moe_ffn
    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        use_cpu_initialization=True, add_bias_linear=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", apply_rope_fusion=False, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.moe_ffn, moe_token_dispatcher_type="alltoall",
        moe_layer_freq=[0] + [1] * (args.layers - 1), expert_model_parallel_size=args.ep, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", moe_shared_expert_intermediate_size=shared)


def layer_spec(name: str, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    import nvfp4_dist as nv
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec, with_sdpa_attention
    if name == "bf16":
        return with_sdpa_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    dispatch = "nvfp4" if name == "nvfp4_dispatch" else "bf16"
    return get_gpt_decoder_block_nvfp4_spec(config, recipe=nv.NVFP4Recipe(moe_dispatch=dispatch))


def build_model(name: str, args):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep)
    config = moe_config(args)
    torch.manual_seed(args.seed)  # the initial weights, and the SR seeds: the same on every rank
    return GPTModel(config=config, transformer_layer_spec=layer_spec(name, config), vocab_size=VOCAB,
                    max_sequence_length=args.seq, position_embedding_type="rope")


def corpus() -> bytes:
    return importlib.resources.files("nvfp4_dist.launch").joinpath("data/fables.txt").read_bytes()


def token_windows(source: str, text: bytes, args, rank: int) -> tuple[torch.Tensor, float | None]:
    """Every micro-batch of the run for this data-parallel rank: int64 [steps * micro_batches, micro_batch, seq + 1]
    (the same for every model), and the Markov chain's entropy rate (nats/byte; None for the corpus)."""
    count = args.steps * args.micro_batches * args.micro_batch
    seed = args.seed * 1000 + rank
    if source == "fables":
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, tokens.numel() - args.seq - 1, (count,), generator=generator)
        windows, entropy = torch.stack([tokens[s:s + args.seq + 1] for s in starts.tolist()]), None
    else:
        from nvfp4_dist.launch.markov_text import MarkovText
        chain = MarkovText(text, order=MARKOV_ORDER)
        windows, entropy = chain.sample(count, args.seq + 1, seed=seed), chain.entropy_rate()
    return windows.view(args.steps * args.micro_batches, args.micro_batch, args.seq + 1), entropy


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}
    return output, loss_func


def micro_batches(windows: torch.Tensor, args):
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, args.seq)
    mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool).triu(1)  # True = masked
    for window in windows:
        yield {"tokens": window[:, :-1], "labels": window[:, 1:], "position_ids": positions, "attention_mask": mask}


def reduce_and_clip(model, max_norm: float) -> float:
    """Megatron's gradient reduction (the non-expert parameters summed over the data-parallel group, the experts'
    (allreduce=False) over the expert data-parallel group; both divided by the data-parallel size), then clipping to
    max_norm on the global norm: the non-expert gradients (equal on every rank) counted once, the experts' of every
    rank. Returns the norm before clipping."""
    from megatron.core import parallel_state
    dense_group = parallel_state.get_data_parallel_group()
    expert_group = parallel_state.get_expert_data_parallel_group()
    dp = dist.get_world_size(dense_group)
    dense_sq, expert_sq = torch.zeros(()), torch.zeros(())
    grads = []
    for param in model.parameters():
        if param.grad is None:
            continue
        is_dense = getattr(param, "allreduce", True)
        dist.all_reduce(param.grad, group=dense_group if is_dense else expert_group)
        param.grad /= dp
        grads.append(param.grad)
        if is_dense:
            dense_sq += param.grad.float().square().sum()
        else:
            expert_sq += param.grad.float().square().sum()
    dist.all_reduce(expert_sq, group=parallel_state.get_expert_model_parallel_group())
    norm = float((dense_sq + expert_sq).sqrt())
    if norm > max_norm:
        for grad in grads:
            grad.mul_(max_norm / (norm + 1e-6))
    return norm


def lr_factor(step: int, args) -> float:
    """Linear warm-up over args.warmup steps, then cosine decay to a tenth of the peak at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(name: str, windows: torch.Tensor, args, log_prefix: str) -> dict:
    """One model trained on the windows; its loss per step (the mean over the data-parallel ranks) and seconds."""
    from megatron.core import parallel_state
    model = build_model(name, args)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and "embedding" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args))
    data = micro_batches(windows, args)
    dp_group = parallel_state.get_data_parallel_group()
    losses, norms = [], []
    with counted_nvfp4_dispatches() as dispatches:
        start = time.perf_counter()
        steps(model, data, optimizer, scheduler, dp_group, args, losses, norms, log_prefix)
        seconds = time.perf_counter() - start
    if not all(math.isfinite(value) for value in losses):
        raise RuntimeError(f"{log_prefix}: a non-finite loss: {losses}")
    experts = [module for name, module in model.named_modules() if name.endswith("mlp.experts")]
    nvfp4_experts = all(getattr(getattr(module, "linear_fc1", None), "last_recipe", None) is not None
                        for module in experts)
    return {"losses": losses, "grad_norms": norms, "seconds": seconds, "nvfp4_dispatch_calls": dispatches.count,
            "experts_type": type(experts[0]).__name__, "experts_ran_nvfp4": nvfp4_experts}


class counted_nvfp4_dispatches(contextlib.AbstractContextManager):
    """Counts the calls of the NVFP4 MoE layer's NVFP4 dispatch (nvfp4_dist.parallel.megatron.moe) while active."""

    def __enter__(self):
        from nvfp4_dist.parallel.megatron import moe
        self.module, self.original, self.count = moe, moe.dispatch_nvfp4, 0

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)
        moe.dispatch_nvfp4 = counted
        return self

    def __exit__(self, *exc):
        self.module.dispatch_nvfp4 = self.original


def steps(model, data, optimizer, scheduler, dp_group, args, losses, norms, log_prefix) -> None:
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        outputs = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=model,
                                              num_microbatches=args.micro_batches, seq_length=args.seq,
                                              micro_batch_size=args.micro_batch, forward_only=False)
        loss = torch.stack([entry["lm loss"] for entry in outputs]).mean()
        dist.all_reduce(loss, group=dp_group)
        losses.append(float(loss) / dist.get_world_size(dp_group))
        norms.append(reduce_and_clip(model, args.clip))
        optimizer.step()
        scheduler.step()
        if dist.get_rank() == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"{log_prefix} step {step:4d}  loss {losses[-1]:.4f}  grad norm {norms[-1]:.3f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)


def worker(rank: int, world_size: int, args) -> dict:
    """Every source and model on this gloo rank (gloo_ranks.run_on_gloo_ranks); rank 0's runs are returned."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    megatron_moe_on_cpu()
    text = corpus()
    runs, entropy = {}, {}
    for source in args.sources:
        windows, entropy[source] = token_windows(source, text, args, rank)
        for name in args.models:
            runs[(source, name)] = train(name, windows, args, f"{source:>6} {name:>14}")
    return {"runs": runs, "entropy": entropy}


# ---------------------------------------------------------------------------------------------------------------
# The JSON.

def final_loss(losses: list[float], window: int) -> float:
    tail = losses[-window:]
    return sum(tail) / len(tail)


def curve(losses: list[float], every: int) -> dict:
    """The loss at steps 0, every, 2 * every, ... and the last step."""
    steps = list(range(0, len(losses), every))
    if steps[-1] != len(losses) - 1:
        steps.append(len(losses) - 1)
    return {"steps": steps, "loss": [round(losses[step], 5) for step in steps]}


def summarise(result: dict, args) -> dict:
    """Per source: each model's final loss, curve and seconds; each NVFP4 model's relative difference to BF16 and
    whether it is within the tolerance."""
    sources = {}
    for source in args.sources:
        models = {}
        for name in args.models:
            run = result["runs"][(source, name)]
            models[name] = {"description": DESCRIPTIONS[name], "final_loss": final_loss(run["losses"],
                                                                                         args.final_window),
                            "first_loss": run["losses"][0], "seconds": run["seconds"],
                            "experts": run["experts_type"], "experts_ran_nvfp4": run["experts_ran_nvfp4"],
                            "nvfp4_dispatch_calls_rank0": run["nvfp4_dispatch_calls"],
                            "curve": curve(run["losses"], args.curve_every)}
        if "bf16" in models:
            reference = models["bf16"]["final_loss"]
            for name, model in models.items():
                if name != "bf16":
                    model["rel_diff_vs_bf16"] = (model["final_loss"] - reference) / reference
                    model["within_tolerance"] = abs(model["rel_diff_vs_bf16"]) <= TOLERANCE
        sources[source] = {"data_entropy_rate": result["entropy"][source], "models": models}
    return sources


def record(args, sources: dict, seconds: float) -> dict:
    import megatron.core
    checks = [model["within_tolerance"] for source in sources.values() for model in source["models"].values()
              if "within_tolerance" in model]
    return {"benchmark": "moe_convergence", "device": "cpu (gloo)", "world_size": args.ep, "ep": args.ep,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": git_commit()[:7],
            "torch": torch.__version__, "megatron_core": megatron.core.__version__, "command": command_line(),
            "settings": {"layers": args.layers, "moe_layers": args.layers - 1, "hidden": args.hidden,
                         "heads": args.heads, "ffn": args.ffn, "moe_ffn": args.moe_ffn, "experts": args.experts,
                         "topk": args.topk, "shared_expert": not args.no_shared_expert, "vocab": VOCAB,
                         "dispatcher": "alltoall", "seq": args.seq, "micro_batch": args.micro_batch,
                         "micro_batches": args.micro_batches, "data_parallel": args.ep,
                         "tokens_per_step": args.seq * args.micro_batch * args.micro_batches * args.ep,
                         "steps": args.steps, "optimizer": "torch AdamW (0.9, 0.95), weight decay 0.1",
                         "lr": args.lr, "warmup": args.warmup, "lr_schedule": "linear warm-up, cosine to lr / 10",
                         "clip_grad": args.clip, "moe_aux_loss_coeff": 0.01, "seed": args.seed,
                         "params_dtype": "float32", "final_window": args.final_window,
                         "curve_every": args.curve_every, "schedule": "megatron get_forward_backward_func",
                         "threads_per_rank": 1},
            "tolerance": TOLERANCE, "passed": all(checks) if checks else None, "seconds": seconds,
            "sources": sources}


def summary_lines(sources: dict) -> list[str]:
    lines = []
    for source, entry in sources.items():
        for name, model in entry["models"].items():
            gap = model.get("rel_diff_vs_bf16")
            verdict = "" if gap is None else (f"  {100 * gap:+.2f}% vs bf16 "
                                              f"({'pass' if model['within_tolerance'] else 'FAIL'})")
            lines.append(f"{source:>6} {name:>14}: final loss {model['final_loss']:.4f} (first "
                         f"{model['first_loss']:.4f}), {model['seconds']:.0f} s{verdict}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size = gloo processes (data-parallel)")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--layers", type=int, default=4, help="the first dense, the others MoE")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128, help="the dense layer's SwiGLU size")
    parser.add_argument("--moe-ffn", type=int, default=64, help="each expert's (and the shared expert's) size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--no-shared-expert", action="store_true")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step and rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--final-window", type=int, default=25, help="final loss: the mean of the last N steps")
    parser.add_argument("--curve-every", type=int, default=10, help="the curves' step interval in the JSON")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="default benchmarks/results/moe_convergence_cpu.json")
    args = parser.parse_args(argv)
    if args.experts % args.ep:
        parser.error(f"--experts {args.experts} must be a multiple of --ep {args.ep}")
    for flag in ("steps", "layers", "seq", "micro_batch", "micro_batches", "final_window", "curve_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.layers < 2:
        parser.error("--layers must be >= 2 (the first layer is dense)")
    for flag in ("hidden", "moe_ffn", "ffn"):
        if getattr(args, flag) % 16:
            parser.error(f"--{flag.replace('_', '-')} must be a multiple of 16 (NVFP4 blocks)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    result = run_on_gloo_ranks(worker, args.ep, args)
    seconds = time.perf_counter() - start
    sources = summarise(result, args)
    print("\n".join(summary_lines(sources)))
    out = args.out or REPOSITORY_ROOT / "benchmarks" / "results" / "moe_convergence_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record(args, sources, seconds), indent=1) + "\n")
    print(f"{seconds:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
