"""nvfp4-train's model and gradient steps in a 4-rank job as TP=2 x DP=2, against each replica's TP=2 job alone.

The 4-rank job builds its groups as nvfp4-train does (launch/trainer.py: TP groups of consecutive ranks, DP groups
strided by TP) and each data-parallel replica trains on its own batch. The oracle of a replica is the same model,
seed and batch in a 2-rank job whose only group is that TP group: each rank's loss, its gradients after the
sequence-parallel reduction, and the gradient norm measured over the TP group must equal it bit for bit (nothing
may mix the replicas' amaxes, gathers or sums); after the data-parallel average, the gradients must be the mean
of the two replicas' own.
"""
import pathlib

import torch
import torch.distributed as dist

from nvfp4_dist.launch.gradients import average_data_parallel_grads, clip_gradients
from nvfp4_dist.launch.model import GPTConfig, TinyGPT, reduce_sequence_parallel_grads
from nvfp4_dist.launch.trainer import parallel_groups
from nvfp4_dist.recipe import NVFP4Recipe
from tests.helpers.distributed import run_distributed
from tests.helpers.topology import TP, WORLD

CONFIG = GPTConfig(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128, seq_length=32, vocab_size=256)
MICRO_BATCH, SEED = 2, 3
TIMEOUT_S = 600


def replica_batch(replica: int) -> tuple:
    """(tokens, labels) [b, s] of one data-parallel replica: other tokens in each."""
    generator = torch.Generator().manual_seed(100 + replica)
    tokens = torch.randint(0, CONFIG.vocab_size, (MICRO_BATCH, CONFIG.seq_length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _step(rank, world_size, replica_alone, out_dir):
    """One forward/backward of nvfp4-train's model; saves this rank's loss, gradients and norm. replica_alone: the
    replica a 2-rank job plays (None in the 4-rank job, where it is rank // TP)."""
    tp_group, dp_group = parallel_groups(world_size, TP)
    replica = rank // TP if replica_alone is None else replica_alone
    torch.manual_seed(SEED)
    model = TinyGPT(CONFIG, tp_group=tp_group, sequence_parallel=True, recipe=NVFP4Recipe(),
                    compute_dtype=torch.bfloat16)
    loss = model(*replica_batch(replica))
    loss.backward()
    reduce_sequence_parallel_grads(model, tp_group)
    norm = clip_gradients(model, 0.0, tp_group)
    result = {"loss": loss.detach(), "norm": norm,
              "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    if replica_alone is None:
        average_data_parallel_grads(model, dp_group, world_size // TP)
        result["averaged"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.save(result, pathlib.Path(out_dir) / f"{'job' if replica_alone is None else 'alone'}_{replica}_"
                                               f"{dist.get_rank(tp_group)}.pt")


def test_each_replica_trains_as_its_tensor_parallel_group_alone(tmp_path):
    run_distributed(_step, WORLD, None, str(tmp_path), timeout_s=TIMEOUT_S)
    for replica in range(WORLD // TP):
        run_distributed(_step, TP, replica, str(tmp_path), timeout_s=TIMEOUT_S)
    load = lambda kind, replica, rank: torch.load(tmp_path / f"{kind}_{replica}_{rank}.pt")  # noqa: E731
    for rank in range(TP):
        job = [load("job", replica, rank) for replica in range(WORLD // TP)]
        alone = [load("alone", replica, rank) for replica in range(WORLD // TP)]
        assert not torch.equal(alone[0]["loss"], alone[1]["loss"]), "the replicas' batches must differ"
        for replica in range(WORLD // TP):
            what = f"replica {replica} TP rank {rank}"
            assert torch.equal(job[replica]["loss"], alone[replica]["loss"]), what + " loss"
            assert job[replica]["norm"] == alone[replica]["norm"], what + " gradient norm over the TP group"
            for name, grad in alone[replica]["grads"].items():
                assert torch.equal(job[replica]["grads"][name], grad), f"{what} gradient of {name}"
        for name in alone[0]["grads"]:
            mean = alone[0]["grads"][name] / 2 + alone[1]["grads"][name] / 2
            for replica in range(WORLD // TP):
                assert torch.equal(job[replica]["averaged"][name], mean), f"TP rank {rank} averaged gradient {name}"
