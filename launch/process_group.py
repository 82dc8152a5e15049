"""A worker's torch.distributed process group and the job's key-value store, bound to the address the job uses.

torch's TCPStore server listens on every interface of its host unless it is handed a listening socket;
gloo and NCCL listen on the interface their *_SOCKET_IFNAME variable names, else on the one the host name
resolves to. Here rank 0 hosts the store on a socket bound to MASTER_ADDR only (loopback for a job on one
machine), and a job whose MASTER_ADDR is loopback keeps gloo's and NCCL's sockets on the loopback
interface as well (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise). Under torchrun the
launcher's agent hosts the store and the workers only connect to it.
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import logging
import os
import socket

import torch
import torch.distributed as dist

LOOPBACK_INTERFACE = "lo"
SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
WATCHDOG_PREFIX = "nvfp4-train/watchdog"
LISTEN_BACKLOG = 2048

log = logging.getLogger("nvfp4_dist")


@dataclasses.dataclass
class Connection:
    """What a worker holds once joined: its rank, device, a store for the watchdog and who hosts it."""

    rank: int
    device: torch.device
    watchdog_store: object
    store_host_rank: int | None


def resolve(host: str) -> list:
    """The IP addresses `host` names (an address names itself)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except socket.gaierror as error:
        raise RuntimeError(f"MASTER_ADDR={host!r} does not resolve ({error})") from None


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface only (a job on one machine)."""
    return all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in resolve(host))


def agent_hosts_store() -> bool:
    """Whether a launcher's agent (torchrun) hosts the store at MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def listening_socket(host: str, port: int) -> int | None:
    """The file descriptor of a TCP socket listening on `host`'s address at `port`, or None when that
    address is not one of this machine's (the store then listens where torch puts it)."""
    for address in resolve(host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(LISTEN_BACKLOG)
        except OSError as error:
            listener.close()
            if error.errno == errno.EADDRNOTAVAIL:  # the address is not this machine's
                continue
            raise RuntimeError(f"MASTER_PORT={port}: cannot listen on {address} ({error.strerror})") from None
        return listener.detach()
    return None


def create_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta):
    """The job's TCPStore: hosted by rank 0 on `host`'s address only, a client of it on the other ranks
    (and on every rank when the launcher's agent hosts it)."""
    if agent_hosts_store() or rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    descriptor = listening_socket(host, port)
    if descriptor is None:
        log.warning("MASTER_ADDR=%s is not an address of rank 0's machine: its store listens on every interface",
                    host)
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout)
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=descriptor)
    except BaseException:
        os.close(descriptor)
        raise


def join(backend: str, *, rank: int, world_size: int, timeout_s: float) -> None:
    """init_process_group from MASTER_ADDR/MASTER_PORT, with the store and sockets bound as the module says."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if is_loopback(host):
        for variable in SOCKET_INTERFACE_VARIABLES:
            os.environ.setdefault(variable, LOOPBACK_INTERFACE)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = create_store(host, port, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def init_process_group(*, device_kind: str, world_size: int, timeout_s: float) -> Connection:
    """Join the job (environment as torchrun sets it, or from MPI), select the device, open the watchdog's store.

    A process group that a launcher initialised already (python -m nvfp4_dist.launch.mpi) is used as it is.
    ValueError when the world is not the one the job was planned for.
    """
    from nvfp4_dist.launch import mpi

    if not dist.is_initialized():
        if os.environ.get("RANK") is None:  # under mpirun/srun without torchrun
            mpi.init_distributed(timeout_s=timeout_s, init_process_group=False)
        if device_kind == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        join("nccl" if device_kind == "cuda" else "gloo", rank=int(os.environ["RANK"]),
             world_size=int(os.environ["WORLD_SIZE"]), timeout_s=timeout_s)
    if dist.get_world_size() != world_size:
        raise ValueError(f"torch.distributed has {dist.get_world_size()} ranks; the launcher announced {world_size}")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    watchdog_store = dist.PrefixStore(f"{WATCHDOG_PREFIX}/{restart}", client)
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    return Connection(dist.get_rank(), device, watchdog_store, None if agent_hosts_store() else 0)
