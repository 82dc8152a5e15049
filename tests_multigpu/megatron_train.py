"""Train Megatron-Core's GPTModel with the NVFP4 spec or Megatron's local BF16 spec, nothing else changed.

In the style of Megatron's examples/run_simple_mcore_train_loop.py: Megatron's process groups, GPTModel,
DistributedDataParallel, get_megatron_optimizer, forward_backward_func and finalize_model_grads; the
only NVFP4-specific line is the layer spec (--spec). Data (vocabulary padded to --vocab), the same token
stream for every TP size: by default text sampled from an order-3 Markov chain of the fables corpus shipped
with nvfp4_dist.launch (never repeated, so losses settle near the chain's entropy rate instead of falling
into memorisation of the 360 KB corpus); --data fables trains on random windows of the corpus itself.

  torchrun --nproc-per-node 2 tests_multigpu/megatron_train.py --tp 2 --sp --spec nvfp4 --out run.json
  ... --recipe-config recipes.yaml --backward-mode dequantized   # per-layer recipes, the backward mode
  ... --nvfp4-4over6 all --no-rht            # 4over6 (docs/numerics.md §12), nvfp4-train's recipe flags
  ... --steps 50 --save /tmp/ckpt            # then evaluate and save a distributed checkpoint
  torchrun --nproc-per-node 4 tests_multigpu/megatron_train.py --tp 4 --steps 0 --load /tmp/ckpt

Prints the final loss (mean of the last 10 steps) and the evaluation loss; --out writes them as JSON.
"""
import argparse
import dataclasses
import importlib.resources
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from nvfp4_dist import NVFP4Recipe, RecipeMap
from nvfp4_dist.environment import BACKWARD_MODES
from nvfp4_dist.launch.cli import add_four_over_six_flags, given_recipe_fields
from nvfp4_dist.launch.markov_text import MarkovText
from nvfp4_dist.parallel.megatron import MEGATRON_CORE_VERSION, get_gpt_decoder_block_nvfp4_spec, with_sdpa_attention

MARKOV_ORDER = 3
MARKOV_CHUNK = 64  # micro-batches sampled per call


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides the GPU count)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (nvfp4 spec only)")
    parser.add_argument("--spec", choices=("nvfp4", "local"), default="nvfp4")
    parser.add_argument("--bf16-first-last", type=int, default=0, metavar="N",
                        help="keep the first N and last N transformer layers in BF16 (nvfp4 spec)")
    parser.add_argument("--overlap", action="store_true", help="recipe.overlap: pipelined TP communication")
    parser.add_argument("--backward-mode", choices=BACKWARD_MODES, default=None,
                        help="recipe.backward_mode (default: NVFP4_BACKWARD_MODE, else default); with "
                             "--row-scaled-activation, dequantized is the row-scaled recipe's BF16 backward")
    parser.add_argument("--no-rht", action="store_true", help="recipe.rht=False (default: NVFP4_DISABLE_RHT)")
    parser.add_argument("--row-scaled-activation", action="store_true",
                        help="recipe.row_scaled_activation=True (default: NVFP4_ROW_SCALED_ACTIVATION)")
    add_four_over_six_flags(parser)
    parser.add_argument("--recipe-config", default=None, metavar="FILE",
                        help="per-layer recipes (YAML or JSON; nvfp4_dist/recipe_map.py) by glob over GPTModel's "
                             "module names, e.g. \"decoder.layers.0.*\": bf16 (nvfp4 spec)")
    parser.add_argument("--attention", choices=("sdpa", "local"), default="sdpa",
                        help="core attention: torch SDPA (both specs) or Megatron's DotProductAttention")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816, help="SwiGLU hidden size")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--data", choices=("markov", "fables"), default="markov",
                        help="markov: new text from an order-3 Markov chain of the corpus; fables: the corpus")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--cpu-init", action="store_true", help="config.use_cpu_initialization")
    parser.add_argument("--save", help="after training: save a distributed checkpoint to this directory")
    parser.add_argument("--load", help="before training: load a distributed checkpoint from this directory")
    parser.add_argument("--out", help="write the results as JSON here (rank 0)")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world % args.tp:
        parser.error(f"--tp {args.tp} must divide the number of processes {world}")
    if args.sp and args.spec == "local":
        parser.error("--sp with --spec local: Megatron's local norm refuses sequence parallelism")
    if args.spec == "local" and (args.recipe_config or recipe_overrides(args)):
        parser.error("--recipe-config and the recipe flags configure the nvfp4 spec; --spec local has no NVFP4 "
                     "layers")
    if args.spec == "nvfp4":
        try:  # a combination the recipe refuses (4over6 on activations with the RHT on, ...): its one-line error
            NVFP4Recipe.from_env(**recipe_overrides(args))
        except ValueError as error:
            parser.error(str(error))
    for name in ("hidden", "ffn", "seq"):
        if getattr(args, name) % (16 * args.tp):
            parser.error(f"--{name} {getattr(args, name)} must be a multiple of 16 * tp = {16 * args.tp}")
    return args


def recipe_overrides(args) -> dict:
    """The recipe fields the flags give (the others: the NVFP4_* environment variables, else the defaults)."""
    overrides = given_recipe_fields(args)
    for flag, field, value in (("overlap", "overlap", True), ("no_rht", "rht", False),
                               ("row_scaled_activation", "row_scaled_activation", True)):
        if getattr(args, flag):
            overrides[field] = value
    return overrides


def initialize_distributed(tp: int) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def model_provider(args) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, tensor_model_parallel_size=args.tp, sequence_parallel=args.sp,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=args.cpu_init, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False)
    if args.spec == "nvfp4":
        overrides = recipe_overrides(args)
        recipe = NVFP4Recipe.from_env(**overrides) if overrides else None
        recipe_map = RecipeMap.from_file(args.recipe_config) if args.recipe_config else None
        spec = get_gpt_decoder_block_nvfp4_spec(config, recipe=recipe, recipe_map=recipe_map,
                                                bf16_first_layers=args.bf16_first_last,
                                                bf16_last_layers=args.bf16_first_last,
                                                sdpa_attention=args.attention == "sdpa")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec = with_sdpa_attention(spec) if args.attention == "sdpa" else spec
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                    max_sequence_length=args.seq, position_embedding_type="rope")


def layer_recipes(model) -> dict:
    """{linear's name: "bf16", or the fields of the recipe its last forward ran with that differ from the defaults}."""
    defaults = NVFP4Recipe()
    recipes = {}
    for name, module in model.named_modules():
        if hasattr(module, "last_recipe") and hasattr(module, "weight_cache"):
            recipe = module.last_recipe
            recipes[name] = "bf16" if recipe is None else {
                field.name: getattr(recipe, field.name) for field in dataclasses.fields(recipe)
                if getattr(recipe, field.name) != getattr(defaults, field.name)}
    return recipes


def corpus() -> bytes:
    return importlib.resources.files("nvfp4_dist.launch").joinpath("data/fables.txt").read_bytes()


def windows_of(text: bytes, source: MarkovText | None, args, stream: int):
    """Endless [micro_batch, seq + 1] token windows on the CPU; the same on every TP rank, distinct per DP rank.
    source: the Markov chain of `text` (--data markov), else None (windows of the text itself)."""
    seed = args.seed * 1000 + stream * 100 + parallel_state.get_data_parallel_rank()
    if source is None:
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        generator = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(0, tokens.numel() - args.seq - 1, (args.micro_batch,), generator=generator)
            yield torch.stack([tokens[s:s + args.seq + 1] for s in starts.tolist()])
    for chunk in itertools.count():  # sampled MARKOV_CHUNK micro-batches at a time (vectorised over sequences)
        samples = source.sample(MARKOV_CHUNK * args.micro_batch, args.seq + 1, seed=seed * 100_000 + chunk)
        yield from samples.split(args.micro_batch)


def batch_iterator(text: bytes, source: MarkovText | None, args, stream: int):
    """Endless micro-batches for Megatron's forward_step_func (windows_of's arguments)."""
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1).cuda()
    causal_mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool).triu(1).cuda()  # True = masked
    for window in windows_of(text, source, args, stream):
        window = window.cuda()
        yield {"tokens": window[:, :-1], "labels": window[:, 1:], "position_ids": positions,
               "attention_mask": causal_mask}


def forward_step_func(data_iterator, model):
    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, loss_func


def run_steps(model, data, args, forward_only: bool) -> float:
    """One optimizer step's forward/backward (or an evaluation batch); the mean loss over DP ranks."""
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data, model=model,
        num_microbatches=args.micro_batches, seq_length=args.seq, micro_batch_size=args.micro_batch,
        decoder_seq_length=args.seq, forward_only=forward_only)
    loss = torch.stack([entry["lm loss"] for entry in losses]).mean()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return float(loss) / parallel_state.get_data_parallel_world_size()


def evaluate(model, text, source, args) -> float:
    model.eval()
    data = batch_iterator(text, source, args, stream=1)
    with torch.no_grad():
        loss = sum(run_steps(model, data, args, forward_only=True) for _ in range(args.eval_batches))
    model.train()
    return loss / args.eval_batches


def main(argv=None) -> dict:
    args = parse_args(argv)
    initialize_distributed(args.tp)
    torch.manual_seed(args.seed)  # the SR seed comes from the CPU generator: same on every TP rank
    model_parallel_cuda_manual_seed(args.seed)
    rank0 = torch.distributed.get_rank() == 0

    gpt_model = model_provider(args).cuda()
    if args.load:
        state = dist_checkpointing.load(sharded_state_dict=gpt_model.sharded_state_dict(prefix=""),
                                        checkpoint_dir=args.load)
        gpt_model.load_state_dict(state)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config=gpt_model.config, ddp_config=ddp_config, module=gpt_model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, bf16=True, clip_grad=1.0, use_distributed_optimizer=False), [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10, lr_warmup_steps=args.warmup,
        lr_decay_steps=max(args.steps, args.warmup + 1), lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=max(args.steps, 1), wd_incr_style="constant")

    text = corpus()
    source = MarkovText(text, order=MARKOV_ORDER) if args.data == "markov" else None
    data = batch_iterator(text, source, args, stream=0)
    losses = []
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(run_steps(model, data, args, forward_only=False))
        finalize_model_grads([model])
        optimizer.step()
        scheduler.step(increment=1)
        if rank0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_step = args.micro_batch * args.micro_batches * args.seq * parallel_state.get_data_parallel_world_size()

    eval_loss = evaluate(model, text, source, args)
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        dist_checkpointing.save(sharded_state_dict=gpt_model.sharded_state_dict(prefix=""),
                                checkpoint_dir=args.save)
    result = {
        "spec": args.spec, "tp": args.tp, "sp": args.sp, "bf16_first_last": args.bf16_first_last,
        "overlap": args.overlap, "steps": args.steps, "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "eval_loss": eval_loss, "losses": losses, "data": args.data, "layer_recipes": layer_recipes(gpt_model),
        "data_entropy_rate": source.entropy_rate() if source is not None else None,
        "tokens_per_s": tokens_per_step * args.steps / elapsed if args.steps else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "megatron_core": MEGATRON_CORE_VERSION, "device": torch.cuda.get_device_name(), "args": vars(args),
    }
    if rank0:
        print(f"final loss {result['final_loss']}  eval loss {eval_loss:.5f}  "
              f"peak memory {result['peak_memory_gib']:.2f} GiB", flush=True)
        if args.spec == "nvfp4":
            for name, recipe in result["layer_recipes"].items():
                print(f"  {name}: {recipe}", flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(result, handle, indent=1)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
