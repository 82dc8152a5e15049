"""A job on one machine listens on loopback only: the store of rank 0 and gloo's sockets of every rank.

Read from /proc (the same table `ss -ltnp` shows): every listening TCP socket of the launcher and its
workers, sampled while they train."""
import ipaddress
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from nvfp4_dist.launch import process_group

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")

LISTEN = "0A"


def listening_sockets() -> dict:
    """{socket inode: (address, port)} of every listening TCP socket in this network namespace."""
    sockets = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != LISTEN:
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word of the address in host (little-endian) order
            address = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            sockets[inode] = (ipaddress.ip_address(address), int(hex_port, 16))
    return sockets


def socket_inodes(pid: int) -> set:
    inodes = set()
    fd_dir = pathlib.Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.exists() else ():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def descendants(pid: int) -> list:
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in pathlib.Path(f"/proc/{current}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            pending.extend(int(child) for child in children)
    return found


def is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_a_one_machine_job_listens_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    job = subprocess.Popen([sys.executable, "-m", "nvfp4_dist.launch.train", "--micro-batch", "4", "--no-progress",
                            "--steps", "100000", "--save-every", "0", "--log-every", "1000",
                            "--out-dir", str(tmp_path)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # every group is set up
            assert job.poll() is None, job.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the job did not train 3 steps in 180 s"
            time.sleep(0.5)
        processes = descendants(job.pid)
        assert len(processes) >= 3  # the launcher and its two workers
        table = listening_sockets()
        listening = {inode: table[inode] for pid in processes for inode in socket_inodes(pid) if inode in table}
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert listening, "the job's store and gloo listen somewhere; nothing was found"
    exposed = {endpoint for endpoint in listening.values() if not is_loopback(endpoint[0])}
    assert not exposed, f"listening beyond loopback: {sorted(map(str, exposed))}"


@pytest.mark.parametrize("world_size, local_world_size, host, expected", [
    ("2", "2", "127.0.0.1", ["127.0.0.1"]),  # one machine: loopback
    ("4", "2", "127.0.0.1", []),  # several machines, yet a loopback name: torch's default, the one others reach
    ("4", "2", "10.1.2.3", ["10.1.2.3"]),  # several machines: the head node's address only
    ("2", None, "127.0.0.1", []),  # the launcher did not say where the ranks are
])
def test_where_rank_0_binds_the_store(monkeypatch, world_size, local_world_size, host, expected):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert process_group.store_addresses(host) == expected


def test_a_master_addr_that_does_not_resolve_is_named():
    with pytest.raises(RuntimeError, match="MASTER_ADDR='no-such-host.invalid' does not resolve"):
        process_group.resolve("no-such-host.invalid")
