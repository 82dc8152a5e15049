"""One rank's training: the model, the optimizer, resuming, and the loop of steps with its reports and checkpoints."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nvfp4_dist import raise_pending_nonfinite
from nvfp4_dist.launch import data, faults, sharding, training_state
from nvfp4_dist.launch.gradients import average_data_parallel_grads, clip_gradients
from nvfp4_dist.launch.optimizer import learning_rate, make_optimizer
from nvfp4_dist.launch.plan import BYTE_VOCAB, check_recipe_config_matches
from nvfp4_dist.linear import WeightCache
from nvfp4_dist.parallel.fsdp import precompute_weight_amaxes
from nvfp4_dist.launch.progress import Reporter, describe_job, memory_mb, summarize


def parallel_groups(world_size: int, tp: int) -> tuple:
    """(tp_group, dp_group) of this rank: TP groups of consecutive ranks, DP groups strided by tp."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world_size, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = group
    for offset in range(tp):
        group = dist.new_group(list(range(offset, world_size, tp)))
        if rank % tp == offset:
            dp_group = group
    return tp_group, dp_group


def build_model(plan, device) -> tuple:
    """(model, tp_group, dp_group): the GPT this job trains, with this rank's shards; model(tokens, labels) -> loss.
    With --fsdp its parameters are sharded over the data-parallel group by FSDP2 (launch/sharding.py)."""
    if plan.model == "megatron":
        from nvfp4_dist.launch.megatron_model import build_megatron_gpt

        return build_megatron_gpt(plan, device)
    from nvfp4_dist.launch.model import GPTConfig, TinyGPT

    args = plan.args
    if plan.fsdp:
        mesh = sharding.parallel_mesh(plan.world_size, plan.tp, device)
        tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    else:
        tp_group, dp_group = parallel_groups(plan.world_size, plan.tp)
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                       ffn_hidden_size=plan.ffn, seq_length=args.seq_length, vocab_size=BYTE_VOCAB)
    dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
    model = TinyGPT(config, tp_group=tp_group, sequence_parallel=args.sp, recipe=plan.recipe,
                    recipe_map=plan.recipe_map, compute_dtype=dtype, device=device)
    if plan.fsdp:
        sharding.shard_model(model, mesh["dp"], model.layers)
    return model, tp_group, dp_group


def linear_names(model) -> list:
    """The module names of the model's NVFP4 linears, as recipe maps match them (their layer_name)."""
    return [module.layer_name for module in model.modules()
            if isinstance(getattr(module, "weight_cache", None), WeightCache) and module.layer_name]


def is_nvfp4_layer(module) -> bool:
    """The layers that the tracer names in reports: nvfp4_dist.parallel's."""
    return type(module).__module__.startswith("nvfp4_dist.parallel")


def forward_backward(model, tokens, labels, tracer) -> tuple:
    """(loss, problem): the local loss after backward, or problem = (where, what) for a NaN/Inf loss or amax."""
    try:
        loss = model(tokens, labels)
    except ValueError as error:
        if not faults.is_nonfinite_amax_error(error):
            raise
        return None, (tracer.current, str(error))
    if not torch.isfinite(loss):
        return None, ("the loss", f"the loss is {loss.item()}")
    try:
        loss.backward()
        raise_pending_nonfinite()  # the GPU's asynchronous amax checks of this step
    except ValueError as error:
        if not faults.is_nonfinite_amax_error(error):
            raise
        return None, (tracer.current, str(error))
    return float(loss.detach()), None


def train(plan, device, rank: int, watchdog) -> None:
    """Train this rank from the latest checkpoint (or step 1) to --steps; rank 0 reports and summarises.

    Raises faults.NonFiniteError to stop at a NaN/Inf (every rank at the same step), SettingError for a
    checkpoint that does not fit.
    """
    from nvfp4_dist.launch.model import reduce_sequence_parallel_grads

    args = plan.args
    torch.manual_seed(args.seed)
    model, tp_group, dp_group = build_model(plan, device)
    if plan.recipe_map is not None:
        check_recipe_config_matches(plan, linear_names(model))
    dp_size, dp_rank = plan.world_size // plan.tp, rank // plan.tp
    optimizer = make_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    tracer = faults.LayerTracer(model, is_nvfp4_layer)
    start_step, resume_message = training_state.resume(plan, model, optimizer, rank=rank, device=device)
    watchdog.beat(start_step)
    reporter = Reporter(args.out_dir, total_steps=args.steps, log_every=args.log_every,
                        progress_bar=not args.no_progress, enabled=rank == 0)
    reporter.line(describe_job(plan, dp_size))
    reporter.line(f"recipe {plan.recipe!r}", echo=False)
    if resume_message:
        reporter.line(resume_message)
    if start_step >= args.steps:
        reporter.line(f"the checkpoint is at step {start_step} >= --steps={args.steps}: nothing to train "
                      f"(raise --steps, or --no-resume to start over)")
    corpus = data.load_corpus(args.data, args.seq_length)
    tokens_per_step = args.micro_batch * args.seq_length * dp_size
    losses, skipped, step_times = [], [], []
    started = time.monotonic()
    last_saved = None
    for step in range(start_step + 1, args.steps + 1):
        step_start = time.monotonic()
        poison = None
        if plan.fault is not None:
            plan.fault.at_step_start(step, rank)
            poison = plan.fault.poison(model, step, is_nvfp4_layer)
        lr = learning_rate(step, peak=args.lr, minimum=args.min_lr, warmup_steps=args.warmup_steps,
                           total_steps=args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens, labels = data.batch_for_step(corpus, seed=args.seed, step=step, dp_rank=dp_rank,
                                             micro_batch=args.micro_batch, seq_length=args.seq_length, device=device)
        loss, problem = forward_backward(model, tokens, labels, tracer)
        if poison is not None:
            poison.remove()
        # Every rank learns whether any rank met a NaN/Inf, so all of them skip (or stop) together.
        flags = torch.tensor([float(problem is not None), loss or 0.0], device=device)
        dist.all_reduce(flags[:1], op=dist.ReduceOp.MAX)
        if flags[0].item() > 0:
            where, what = problem or ("another rank", "another rank met a NaN/Inf value")
            if args.on_nonfinite == "stop":
                raise faults.NonFiniteError(step, where, what)
            optimizer.zero_grad(set_to_none=True)
            skipped.append(step)
            reporter.line(f"step {step}: skipped the update: non-finite value in {where}: {what}")
            record = {"step": step, "loss": None, "skipped": f"{where}: {what}", "lr": lr, "tokens_per_s": 0.0,
                      "memory_mb": memory_mb(device)}
        else:
            dist.all_reduce(flags[1:], group=dp_group)
            reduce_sequence_parallel_grads(model, tp_group)
            if not plan.fsdp:  # FSDP2 reduce-scattered the gradients, averaged, in backward
                average_data_parallel_grads(model, dp_group, dp_size)
            grad_norm = clip_gradients(model, args.grad_clip, tp_group, dp_group if plan.fsdp else None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if plan.fsdp:  # the next step's weight amaxes, all in one all-reduce
                precompute_weight_amaxes(model)
            step_loss = flags[1].item() / dp_size
            losses.append((step, step_loss))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.monotonic() - step_start
            step_times.append(elapsed)
            record = {"step": step, "loss": step_loss, "grad_norm": grad_norm, "lr": lr,
                      "tokens_per_s": tokens_per_step / elapsed, "memory_mb": memory_mb(device)}
        watchdog.beat(step)
        reporter.step(record)
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
            last_saved = training_state.save(plan, step, model, optimizer, rank=rank, device=device)
            reporter.line(f"step {step}: saved checkpoint {last_saved}", echo=False)
    watchdog.stop()
    dist.barrier()
    if rank == 0:
        summarize(reporter, plan, losses=losses, skipped=skipped, step_times=step_times,
                  tokens_per_step=tokens_per_step, total_s=time.monotonic() - started, device=device,
                  last_saved=last_saved)
    reporter.close()
    tracer.remove()
