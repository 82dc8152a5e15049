"""What the multi-GPU benchmarks share: the class of links they run over, their NCCL process group (one GPU per
local rank, started by torchrun) and how their results are named and labelled.

Link classes (--links), set in the environment before the process group starts (docs/slow_links.md):
  nvlink    the host's own transports: NCCL peer-to-peer over NVLink, and symmetric memory (copy engines, peer
            kernels) for the NVFP4 collectives and the overlap's rings
  slow      no peer-to-peer: NCCL moves everything through host memory, the library uses NCCL only
            (NCCL_P2P_DISABLE=1, NVFP4_SYMMETRIC_MEMORY=0); the class of PCIe or one NIC per GPU
  two-node  as slow, and without shared memory either: NCCL's socket transport over loopback, the transport
            between two nodes (NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo); with
            tests_multigpu/two_node_local.sh the ranks also belong to two torchrun agents
Every class sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1: NVLink multicast is never used.
A variable the class sets must be unset or already hold that value, and a variable of a slower class must be
unset: a run never carries a link label that its environment contradicts.

    python benchmarks/torchrun_setup.py --links two-node    # the class's variables as shell export lines
"""
from __future__ import annotations

import argparse
import os
import re
import shlex

LINKS = ("nvlink", "slow", "two-node")
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_NO_PEER_TO_PEER = {"NCCL_P2P_DISABLE": "1", "NVFP4_SYMMETRIC_MEMORY": "0"}
_SOCKETS = {"NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}
LINK_ENVIRONMENTS = {"nvlink": dict(_NO_MULTICAST),
                     "slow": {**_NO_MULTICAST, **_NO_PEER_TO_PEER},
                     "two-node": {**_NO_MULTICAST, **_NO_PEER_TO_PEER, **_SOCKETS}}
# Variables that make a class slower than another; NCCL_SOCKET_IFNAME only picks the interface of NCCL_NET=Socket.
_CLASS_VARIABLES = ("NCCL_P2P_DISABLE", "NVFP4_SYMMETRIC_MEMORY", "NCCL_SHM_DISABLE", "NCCL_NET")
_SAME_VALUES = {("NVFP4_SYMMETRIC_MEMORY", "0"): ("0", "off")}  # spellings the variable's reader takes alike


def _means(name: str, present: str, value: str) -> bool:
    """Whether `present` (a variable's text) sets what `value` does."""
    return present.strip().lower() in _SAME_VALUES.get((name, value), (value.lower(),))


def add_links_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--links", choices=LINKS, default="nvlink",
                        help="links to run over: the host's own (nvlink), no peer-to-peer (slow), or NCCL sockets "
                             "as between two nodes (two-node); see benchmarks/torchrun_setup.py (default nvlink)")


def link_environment(links: str) -> dict:
    """The environment variables of a link class, after checking the current environment does not contradict it."""
    if links not in LINKS:
        raise ValueError(f"links={links!r}: allowed are {LINKS}")
    wanted = LINK_ENVIRONMENTS[links]
    for name in sorted(set(wanted) | set(_CLASS_VARIABLES)):
        present = os.environ.get(name, "")
        if name in wanted and present and not _means(name, present, wanted[name]):
            raise SystemExit(f"--links {links} sets {name}={wanted[name]}, but the environment has "
                             f"{name}={present}: unset it")
        slower = next(c for c in LINKS if name in LINK_ENVIRONMENTS[c])
        if name not in wanted and present and _means(name, present, LINK_ENVIRONMENTS[slower][name]):
            raise SystemExit(f"the environment has {name}={present}, a setting of --links {slower}, not of "
                             f"--links {links}: unset it or pass --links {slower}")
    return dict(wanted)


def apply_links(links: str) -> dict:
    """Set a link class's environment in this process (before any NCCL communicator exists); returns it."""
    environment = link_environment(links)
    os.environ.update(environment)
    return environment


def torchrun_nodes() -> int:
    """How many torchrun agents (nodes) the job has: WORLD_SIZE / LOCAL_WORLD_SIZE."""
    return int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def links_record(links: str) -> dict:
    """What a result JSON records about its links."""
    return {"links": links, "link_environment": LINK_ENVIRONMENTS[links], "torchrun_nodes": torchrun_nodes()}


def init_nccl(links: str) -> tuple:
    """Set the link class's environment, bind this process to GPU LOCAL_RANK and join the NCCL group;
    returns (rank, world size)."""
    import torch
    import torch.distributed as dist
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("start this benchmark with torchrun (LOCAL_RANK is not set)")
    apply_links(links)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return dist.get_rank(), dist.get_world_size()


def gpu_label(name: str | None = None) -> str:
    """'h200' from 'NVIDIA H200', 'h100' from 'NVIDIA H100 80GB HBM3' (else the name, lower case, no spaces); the
    current CUDA device's name by default."""
    if name is None:
        import torch
        name = torch.cuda.get_device_name()
    model = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", name)
    return (model.group(0) if model else name.replace(" ", "_")).lower()


def result_path(stem: str, links: str) -> str:
    """benchmarks/results/<stem>_<links>.json: one file per benchmark, GPU kind, size and link class."""
    return os.path.join("benchmarks", "results", f"{stem}_{links}.json")


def main() -> None:
    parser = argparse.ArgumentParser(description="Print a link class's environment as shell export lines.")
    parser.add_argument("--links", choices=LINKS, required=True)
    args = parser.parse_args()
    for name, value in link_environment(args.links).items():
        print(f"export {name}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
