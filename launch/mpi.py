"""Start torch.distributed under mpirun or srun, without torchrun.

    mpirun -np 4 python -m nvfp4_dist.launch.mpi train.py --my-flag
    mpirun -np 4 python -m nvfp4_dist.launch.mpi -m nvfp4_dist.launch.train --tp 2

From MPI: the global rank and size, the local rank (shared-memory split) and the node
count. Rank 0 picks the rendezvous address and a free port and broadcasts them. Each
process then gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR and MASTER_PORT, selects its CUDA device and initialises torch.distributed
(NCCL on GPUs, gloo on CPU), rank 0's store bound to the rendezvous address only
(nvfp4_dist.launch.process_group). As a function: `init_distributed()`.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import runpy
import socket
import sys

INSTALL_HINT = ("install an MPI runtime and mpi4py, for example "
                "`apt-get install libopenmpi-dev openmpi-bin && pip install mpi4py` "
                "(or `pip install nvfp4-dist[mpi]` once MPI is there)")
# Environment variables by which launchers announce the world size, to catch an mpi4py built for another MPI.
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "MPI_LOCALNRANKS")


def import_mpi():
    """mpi4py's MPI module, or a RuntimeError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(f"nvfp4_dist.launch.mpi needs mpi4py and an MPI runtime ({error}); {INSTALL_HINT}") from None
    except RuntimeError as error:  # mpi4py present, but libmpi missing or failing to initialise
        raise RuntimeError(f"MPI could not start ({error}); {INSTALL_HINT}") from None
    return MPI


@dataclasses.dataclass(frozen=True)
class MPIEnvironment:
    """Where this process sits in the job, as derived from MPI."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int

    def as_env(self) -> dict:
        """The torchrun-style environment variables for this process."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "NODE_RANK": str(self.node_rank), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def assign_nodes(node_leaders: list) -> tuple:
    """Node index of every rank and the node count, from the global rank of each rank's node leader."""
    leaders = sorted(set(node_leaders))
    index = {leader: node for node, leader in enumerate(leaders)}
    return [index[leader] for leader in node_leaders], len(leaders)


def rendezvous_address(num_nodes: int) -> str:
    """MASTER_ADDR as rank 0 sees it: its environment, loopback on one node, else its non-loopback address."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if num_nodes == 1:
        return "127.0.0.1"
    hostname = socket.gethostname()
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return hostname
    for *_, sockaddr in infos:
        if not ipaddress.ip_address(sockaddr[0]).is_loopback:
            return sockaddr[0]
    return hostname


def free_port(address: str) -> int:
    """A TCP port that is free on `address` now (MASTER_PORT from the environment wins)."""
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            probe.bind(("", 0))
        return probe.getsockname()[1]


def check_launcher_size(world_size: int) -> None:
    """Fail clearly when the launcher started more processes than MPI reports (mpi4py built for another MPI)."""
    for variable in LAUNCHER_SIZE_VARIABLES:
        announced = os.environ.get(variable)
        if announced and announced.isdigit() and int(announced) != world_size and world_size == 1:
            raise RuntimeError(
                f"{variable}={announced} but MPI reports a world of {world_size}: mpi4py is built against a "
                f"different MPI than the launcher's; reinstall it with `pip install --no-binary mpi4py "
                f"--force-reinstall mpi4py` using the launcher's mpicc")


def derive_environment(comm=None) -> MPIEnvironment:
    """Rank, local rank, node layout and rendezvous point of this process (collective over `comm`)."""
    MPI = import_mpi()
    comm = comm if comm is not None else MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    check_launcher_size(world_size)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_world_size = local.Get_rank(), local.Get_size()
        leader = local.bcast(rank, root=0)
    finally:
        local.Free()
    node_of_rank, num_nodes = assign_nodes(comm.allgather(leader))
    rendezvous = None
    if rank == 0:
        address = rendezvous_address(num_nodes)
        rendezvous = (address, free_port(address))
    master_addr, master_port = comm.bcast(rendezvous, root=0)
    return MPIEnvironment(rank, world_size, local_rank, local_world_size, node_of_rank[rank], num_nodes,
                          master_addr, master_port)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0, init_process_group: bool = True,
                     comm=None) -> MPIEnvironment:
    """Set the torchrun environment from MPI, select the CUDA device, initialise torch.distributed.

    backend: "nccl" or "gloo" (default: NCCL when CUDA is available, else gloo).
    timeout_s: the process group's collective timeout.
    init_process_group=False only exports the environment (for scripts that initialise themselves).
    """
    import torch
    import torch.distributed as dist

    from nvfp4_dist.launch import process_group

    environment = derive_environment(comm)
    os.environ.update(environment.as_env())
    if torch.cuda.is_available():
        torch.cuda.set_device(environment.local_rank % torch.cuda.device_count())
    if init_process_group and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r}: allowed are 'nccl' and 'gloo'")
        process_group.join(backend, rank=environment.rank, world_size=environment.world_size, timeout_s=timeout_s)
    return environment


OPTIONS_WITH_VALUES = ("--backend", "--timeout")


def split_target(argv: list) -> tuple:
    """(launcher options, target): the target starts at `-m MODULE` or at the first positional argument."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "-m" or not token.startswith("-"):
            return argv[:index], argv[index:]
        index += 2 if token in OPTIONS_WITH_VALUES else 1
    return argv, []


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m nvfp4_dist.launch.mpi",
        usage="python -m nvfp4_dist.launch.mpi [options] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a script or module under mpirun/srun with torch.distributed initialised from MPI.")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="process-group backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    parser.add_argument("--no-init", action="store_true",
                        help="only export RANK/WORLD_SIZE/... and select the device; the target initialises itself")
    options, target = split_target(list(argv))
    args = parser.parse_args(options)
    if not target or target == ["-m"]:
        parser.error("give a script path or -m MODULE to run")
    if args.timeout <= 0:
        parser.error(f"--timeout={args.timeout}: must be > 0 seconds")
    args.module = target[1] if target[0] == "-m" else None
    args.target = target[2:] if args.module else target
    return args


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        init_distributed(args.backend, args.timeout, init_process_group=not args.no_init)
    except RuntimeError as error:
        print(f"nvfp4_dist.launch.mpi: {error}", file=sys.stderr)
        sys.exit(1)
    if args.module is not None:
        sys.argv = [args.module, *args.target]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args.target)
        runpy.run_path(args.target[0], run_name="__main__")


if __name__ == "__main__":
    main()
