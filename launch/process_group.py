"""A worker's torch.distributed process group and the job's key-value store, bound to the address the job uses.

torch's TCPStore server listens on every interface of its host unless it is handed a listening socket;
gloo and NCCL listen on the interface their *_SOCKET_IFNAME variable names, else on the one the host name
resolves to. Here rank 0 hosts the store on a socket bound to MASTER_ADDR's address only: loopback for a job
on one machine, whose gloo and NCCL sockets stay on the loopback interface as well (unless
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise). A job that spans machines binds to MASTER_ADDR's
address where it is not a loopback one (a host name that resolves to loopback on its own host, as
/etc/hosts often has it, leaves torch's defaults, the only ones the other nodes can reach). Under torchrun
the launcher's agent hosts the store and the workers only connect to it.
"""
from __future__ import annotations

import contextlib
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
SECRET_BYTES = 32

log = logging.getLogger("nvfp4_dist")


@dataclasses.dataclass
class Connection:
    """What a worker holds once joined: its rank, device, a store for the watchdog and who hosts it, and the job's
    secret (shared_secret: it signs the watchdog's verdicts)."""

    rank: int
    device: torch.device
    watchdog_store: object
    store_host_rank: int | None
    secret: bytes


def resolve(host: str) -> list:
    """The IP addresses `host` names (an address names itself)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except socket.gaierror as error:
        raise RuntimeError(f"MASTER_ADDR={host!r} does not resolve ({error})") from None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def on_one_machine() -> bool:
    """Whether every rank of the job runs on this machine (as the launcher announces it)."""
    world_size = os.environ.get("WORLD_SIZE")
    return bool(world_size) and os.environ.get("LOCAL_WORLD_SIZE") == world_size


def store_addresses(host: str) -> list:
    """The addresses of `host` that rank 0's store may bind to without locking out another node."""
    addresses = resolve(host)
    if all(is_loopback(address) for address in addresses):
        return addresses if on_one_machine() else []
    return [address for address in addresses if not is_loopback(address)]


def agent_hosts_store() -> bool:
    """Whether a launcher's agent (torchrun) hosts the store at MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def listening_socket(addresses: list, port: int) -> int | None:
    """The file descriptor of a TCP socket listening on the first of `addresses` that is this machine's, at
    `port`, or None when there is none (the store then listens where torch puts it)."""
    for address in addresses:
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
    descriptor = listening_socket(store_addresses(host), port)
    if descriptor is None:
        log.info("MASTER_ADDR=%s: rank 0's store listens on every interface", host)
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout)
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=descriptor)
    except BaseException:
        with contextlib.suppress(OSError):  # unless the store took it over already
            os.close(descriptor)
        raise


def join(backend: str, *, rank: int, world_size: int, timeout_s: float) -> None:
    """init_process_group from MASTER_ADDR/MASTER_PORT, with the store and sockets bound as the module says."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if on_one_machine() and all(is_loopback(address) for address in resolve(host)):
        for variable in SOCKET_INTERFACE_VARIABLES:
            os.environ.setdefault(variable, LOOPBACK_INTERFACE)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = create_store(host, port, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def shared_secret(device: torch.device) -> bytes:
    """SECRET_BYTES random bytes drawn by rank 0 and broadcast over the process group (a collective): every rank
    of the job knows them, and the store, which anything that reaches its port can read and write, never does."""
    secret = torch.frombuffer(bytearray(os.urandom(SECRET_BYTES)), dtype=torch.uint8).to(device)
    dist.broadcast(secret, src=0)
    return bytes(secret.cpu().tolist())


def init_process_group(*, device_kind: str, world_size: int, timeout_s: float,
                       watchdog_timeout_s: float) -> Connection:
    """Join the job (environment as torchrun sets it, or from MPI), select the device, open the watchdog's store,
    share the job's secret.

    timeout_s: the process group's collective timeout; watchdog_timeout_s: that of the watchdog's store calls.

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
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=watchdog_timeout_s))
    watchdog_store = dist.PrefixStore(f"{WATCHDOG_PREFIX}/{restart}", client)
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    return Connection(dist.get_rank(), device, watchdog_store, None if agent_hosts_store() else 0,
                      shared_secret(device))
