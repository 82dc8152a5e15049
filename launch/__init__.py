"""Launchers and the main training job (docs/launching.md).

- nvfp4_dist.launch.train: the `nvfp4-train` job (CPU default: 2 gloo processes, TP=2; GPUs: Megatron-Core).
- nvfp4_dist.launch.mpi: torch.distributed from mpirun/srun, without torchrun.
- torchrun_multinode.sh, slurm_torchrun.sbatch, slurm_mpi.sbatch: multi-node recipes.
"""
