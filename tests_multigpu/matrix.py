"""The multi-GPU test matrix: world size x TP size x SP x overlap x recipe x layer kind.

Run from the repository root, as a module. Driver (runs one launch per world size, merges, prints the table,
exits non-zero on any failure):
    python -m tests_multigpu.matrix --driver --max-world 4 --launcher torchrun --out out/matrix
    python -m tests_multigpu.matrix --driver --max-world 4 --launcher mpirun --out out/matrix
    python -m tests_multigpu.matrix --driver --device cpu --quick --max-world 2 --out /tmp/m   # CI, gloo
One world size (what the driver launches; all of that world's cells run inside this one launch):
    torchrun --standalone --nproc-per-node 4 -m tests_multigpu.matrix --world 4 --out out/matrix
    mpirun -np 4 python -m tests_multigpu.matrix --world 4 --launcher mpirun --out out/matrix
Options: --profile b200 adds the native cuBLASLt NVFP4 GEMM cells ("not run" without sm_100); --quick
runs the recipes default and row_scaled only; --only REGEX keeps the cells whose name matches.
What each cell checks, and the tolerances: tests_multigpu/matrix_cells.py.
Output (--out): matrix_world<W>.json per launch (written after every cell), matrix_world<W>.log,
and from the driver matrix_report.json and matrix_table.txt.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import faulthandler
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

if not __package__:
    raise SystemExit("run the matrix from the repository root as a module: python -m tests_multigpu.matrix ...")
from tests_multigpu import matrix_cells as M  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
MODULE = "tests_multigpu.matrix"
STATUSES = ("passed", "failed", "not run")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", action="store_true", help="launch every world size and merge the reports")
    parser.add_argument("--world", type=int, help="(worker) the world size this launch must have")
    parser.add_argument("--max-world", type=int, default=None,
                        help="driver: largest world size to launch (default: the GPU count; 2 on CPU)")
    parser.add_argument("--launcher", choices=("torchrun", "mpirun"), default="torchrun")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "out" / "matrix")
    parser.add_argument("--quick", action="store_true", help="recipes default and row_scaled only (CI)")
    parser.add_argument("--profile", choices=("b200",), default=None,
                        help="b200: also compare gemm(backend='cublaslt') with the emulated and reference GEMMs")
    parser.add_argument("--only", default=None, help="run only the cells whose name matches this regex")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 128; 32 on CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 256; 64 on CPU)")
    parser.add_argument("--ffn", type=int, default=None, help="FFN size (default 512; 128 on CPU)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 8; 4 on CPU)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--pg-timeout", type=float, default=300.0, help="collective timeout in seconds")
    parser.add_argument("--cell-timeout", type=float, default=300.0,
                        help="seconds after which a hung cell dumps the stacks and ends its launch")
    parser.add_argument("--launch-timeout", type=float, default=1800.0, help="driver: seconds per launch")
    parser.add_argument("--git-commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = parser.parse_args(argv)
    if not args.driver and args.world is None:
        parser.error("give --driver, or --world W for one launch")
    return args


def shapes_of(args) -> M.Shapes:
    """GPU: tokens 128 x 2, hidden 256, ffn 512, 8 heads. CPU (the reference path is slow): 32 x 2, 64, 128, 4."""
    cpu = args.device == "cpu"
    return M.Shapes(seq=args.seq or (32 if cpu else 128), batch=args.batch,
                    hidden=args.hidden or (64 if cpu else 256), ffn=args.ffn or (128 if cpu else 512),
                    heads=args.heads or (4 if cpu else 8))


def selected_cells(world: int, args) -> list[M.Cell]:
    cells = M.enumerate_cells(world, quick=args.quick, profile=args.profile)
    if args.only:
        pattern = re.compile(args.only)
        cells = [cell for cell in cells if pattern.search(cell.name)]
    return cells


def git_commit(args) -> str:
    if args.git_commit:
        return args.git_commit
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+dirty" if dirty else "")) if commit else "unknown"


def environment(args, device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = "sm_%d%d" % torch.cuda.get_device_capability(device)
    else:
        name, capability = f"cpu ({platform.processor() or platform.machine()})", None
    try:
        from megatron.core.package_info import __version__ as megatron_version
    except ImportError:
        megatron_version = None
    return dict(device=name, capability=capability, torch=torch.__version__, cuda=torch.version.cuda,
                megatron_core=megatron_version, git_commit=git_commit(args), host=platform.node(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                launcher=args.launcher, gpus_present=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def write_json(path: pathlib.Path, payload: dict) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(temporary, path)


# ------------------------------------------------------------------------------------------------------
# One launch: all cells of one world size.

def init_distributed(args) -> torch.device:
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.launcher == "mpirun":
        from nvfp4_dist.launch.mpi import init_distributed as init_from_mpi
        init_from_mpi(backend, args.pg_timeout)
    else:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    if args.device == "cuda":  # the emulation quantizes on the CPU: share the cores among the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    return torch.device("cpu")


def merge_ranks(results: list[dict]) -> dict:
    """One cell's record from every rank's result: failed if any rank failed; worst errors and times."""
    failed = [(rank, r) for rank, r in enumerate(results) if r["status"] == "failed"]
    not_run = [r for r in results if r["status"] == "not run"]
    merged = dict(status="failed" if failed else ("not run" if not_run else "passed"))
    if failed:
        merged["reason"] = " | ".join(f"rank {rank}: {r['reason']}" for rank, r in failed[:2])
        if "traceback" in failed[0][1]:
            merged["traceback"] = failed[0][1]["traceback"]
    else:
        merged["reason"] = not_run[0]["reason"] if not_run else ""
        if not_run and "missing" in not_run[0]:
            merged["missing"] = not_run[0]["missing"]
    merged["seconds"] = round(max(r["seconds"] for r in results), 4)
    for field in ("max_abs_err", "tp1_rel_err"):
        combined: dict = {}
        for r in results:
            for name, value in r.get(field, {}).items():
                combined[name] = max(combined.get(name, 0.0), value)
        merged[field] = combined
        if combined:
            merged[f"{field}_worst"] = max(combined.values())
    if any("ring_schedules" in r for r in results):
        merged["ring_schedules"] = min(r.get("ring_schedules", 0) for r in results)
    if any("tp1_rel_err_rms" in r for r in results):
        merged["tp1_rel_err_rms"] = max(r.get("tp1_rel_err_rms", 0.0) for r in results)
    return merged


def run_world(args) -> int:
    device = init_distributed(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != args.world:
        raise SystemExit(f"--world {args.world} but the launcher started {world} processes")
    ctx = M.Context.create(device, shapes_of(args), seed=args.seed)
    cells = selected_cells(world, args)
    # Megatron re-initialises its groups per TP size: its cells run last, grouped by TP size.
    order = [c for c in cells if c.kind != "megatron"] + sorted((c for c in cells if c.kind == "megatron"),
                                                                 key=lambda c: c.tp)
    megatron_reason = M.megatron_missing() if any(c.kind == "megatron" for c in cells) else None
    megatron = None
    if any(c.kind == "megatron" for c in cells) and not megatron_reason:
        megatron = M.MegatronPhase(ctx)
        megatron.prepare([c for c in order if c.kind == "megatron"])
    path = args.out / f"matrix_world{world}.json"
    report = dict(environment(args, device), world=world, shapes=vars(ctx.shapes), quick=args.quick,
                  profile=args.profile, cells=[])
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"matrix world {world}: {len(order)} cells on {report['device']}", flush=True)
    started = time.perf_counter()
    for index, cell in enumerate(order):
        # A hung cell (a rank stuck in a collective) dumps every thread's stack and ends the launch.
        faulthandler.dump_traceback_later(args.cell_timeout, exit=True)
        result = M.run_cell(cell, ctx, megatron, megatron_reason)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            record = dict(cell.describe(), **merge_ranks(gathered))
            report["cells"].append(record)
            report["seconds"] = round(time.perf_counter() - started, 2)
            write_json(path, report)
            print(f"[{index + 1}/{len(order)}] {cell.name}: {record['status']} ({record['seconds']:.2f} s)"
                  + (f" {record['reason'][:300]}" if record["reason"] else ""), flush=True)
    if megatron is not None:
        megatron.close()
    failed = sum(r["status"] == "failed" for r in report["cells"]) if rank == 0 else 0
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------------
# Driver: a launch per world size, then one report.

def worker_arguments(args, world: int) -> list[str]:
    forwarded = ["--world", str(world), "--launcher", args.launcher, "--device", args.device, "--out", str(args.out),
                 "--batch", str(args.batch), "--seed", str(args.seed), "--pg-timeout", str(args.pg_timeout),
                 "--cell-timeout", str(args.cell_timeout),
                 "--git-commit", git_commit(args)]
    for flag, value in (("--profile", args.profile), ("--only", args.only), ("--seq", args.seq),
                        ("--hidden", args.hidden), ("--ffn", args.ffn), ("--heads", args.heads)):
        if value is not None:
            forwarded += [flag, str(value)]
    return forwarded + (["--quick"] if args.quick else [])


def launch_command(args, world: int) -> list[str]:
    worker = ["-m", MODULE, *worker_arguments(args, world)]
    if args.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *worker]
    command = ["mpirun", "-np", str(world), "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if args.device == "cpu":
        command.append("--oversubscribe")
    return [*command, sys.executable, *worker]


def launch(args, world: int) -> dict:
    """Run one world size's launch; returns {'rc', 'seconds', 'log', 'cells': {name: record}}."""
    log_path = args.out / f"matrix_world{world}.log"
    json_path = args.out / f"matrix_world{world}.json"
    json_path.unlink(missing_ok=True)
    command = launch_command(args, world)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"launch world {world}: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.launch_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = round(time.perf_counter() - started, 1)
    report = json.loads(json_path.read_text()) if json_path.exists() else {}
    print(f"launch world {world}: rc {rc}, {seconds} s, {len(report.get('cells', []))} cells reported "
          f"(log {log_path})", flush=True)
    return dict(rc=rc, seconds=seconds, log=str(log_path), report=report,
                cells={record["name"]: record for record in report.get("cells", [])})


def world_not_run(args, world: int, gpus: int) -> dict | None:
    """The "not run" result of every cell of a world size this machine (or --max-world) leaves out, else None."""
    if args.device == "cuda" and world > gpus:
        return M.not_run(f"needs {world} GPUs ({gpus} present)", "gpus")
    if world > args.max_world:
        return M.not_run(f"world size {world} above --max-world {args.max_world}", "max-world")
    return None


def unexplained_not_run(cells: list[dict]) -> list[dict]:
    """The cells reported "not run" for a reason other than a missing resource: each fails the driver."""
    return [c for c in cells if c["status"] == "not run" and c.get("missing") not in M.MISSING_RESOURCES]


def drive(args) -> int:
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if args.device == "cuda" and torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda but no GPU is visible; use --device cpu (gloo) on a CPU machine")
    if args.max_world is None:
        args.max_world = gpus if args.device == "cuda" else 2
    cells, launches, header = [], {}, None
    for world in M.WORLD_SIZES:
        wanted = selected_cells(world, args)
        skipped = world_not_run(args, world, gpus)
        if skipped:
            cells += [dict(c.describe(), **skipped, seconds=0.0) for c in wanted]
            continue
        if not wanted:
            continue
        outcome = launch(args, world)
        launches[world] = dict(rc=outcome["rc"], seconds=outcome["seconds"], log=outcome["log"])
        header = header or {k: v for k, v in outcome["report"].items() if k != "cells"}
        for cell in wanted:
            record = outcome["cells"].get(cell.name)
            if record is None:
                record = dict(cell.describe(), status="failed", seconds=0.0,
                              reason=f"no result: the world-{world} launch ended with rc {outcome['rc']} before this "
                                     f"cell (see {outcome['log']})")
            cells.append(record)
    counts = collections.Counter(c["status"] for c in cells)
    report = dict(header or environment(args, torch.device("cpu")), launches=launches, max_world=args.max_world,
                  quick=args.quick, profile=args.profile, only=args.only,
                  summary={status: counts.get(status, 0) for status in STATUSES}, cells=cells)
    for per_launch in ("world", "seconds"):
        report.pop(per_launch, None)
    write_json(args.out / "matrix_report.json", report)
    grouped, full = tables(cells)
    (args.out / "matrix_table.txt").write_text(full + "\n")
    print(grouped)
    failed_launches = [w for w, l in launches.items() if l["rc"] != 0]
    unexplained = unexplained_not_run(cells)
    print(f"\ncells: {len(cells)}  passed: {counts['passed']}  failed: {counts['failed']}  "
          f"not run: {counts['not run']}   (report {args.out / 'matrix_report.json'})")
    if failed_launches:
        print(f"launches that exited non-zero: world {failed_launches}")
    if unexplained:
        print(f"not run without a missing resource ({', '.join(M.MISSING_RESOURCES)}), counted as failures:")
        for c in unexplained:
            print(f"  {c['name']}: {c['reason'][:300]}")
    return 1 if counts["failed"] or failed_launches or unexplained else 0


def tables(cells: list[dict]) -> tuple[str, str]:
    """(grouped table: one row per parallel configuration, one column per kind; full per-cell table)."""
    kinds = list(dict.fromkeys(c["kind"] for c in cells))
    groups: dict = collections.OrderedDict()
    for c in cells:
        groups.setdefault((c["world"], c["tp"], c["dp"], c["sp"], c["overlap"]), []).append(c)
    header = f"{'world':>5} {'tp':>3} {'dp':>3} {'sp':>3} {'overlap':>7}  " + "  ".join(f"{k:>14}" for k in kinds)
    lines = [header, "-" * len(header)]
    for (world, tp, dp, sp, overlap), members in groups.items():
        entries = []
        for kind in kinds:
            counts = collections.Counter(c["status"] for c in members if c["kind"] == kind)
            text = " ".join(f"{counts[s]}{s[0].upper()}" for s in STATUSES if counts[s])
            entries.append(f"{text or '-':>14}")
        lines.append(f"{world:>5} {tp:>3} {dp:>3} {'on' if sp else 'off':>3} {'on' if overlap else 'off':>7}  "
                     + "  ".join(entries))
    lines.append("(P passed, F failed, N not run; per kind, over the recipe variants)")
    reasons = collections.Counter((c["reason"], c.get("missing", "NO MISSING RESOURCE: a failure"))
                                  for c in cells if c["status"] == "not run")
    if reasons:
        lines.append("not run (what is missing):")
        lines += [f"  {count:4d} x {reason} [{missing}]" for (reason, missing), count in reasons.most_common()]
    failures = [c for c in cells if c["status"] == "failed"]
    if failures:
        lines.append("failed:")
        lines += [f"  {c['name']}: {c['reason'][:400]}" for c in failures]
    full = [f"{'cell':<52} {'status':<8} {'seconds':>8} {'max_abs_err':>11} {'tp1_rel':>8}  reason"]
    for c in cells:
        abs_err, rel_err = c.get("max_abs_err_worst"), c.get("tp1_rel_err_worst")
        full.append(f"{c['name']:<52} {c['status']:<8} {c['seconds']:>8.2f} "
                    f"{'' if abs_err is None else f'{abs_err:.2e}':>11} {'' if rel_err is None else f'{rel_err:.3f}':>8}"
                    f"  {c.get('reason', '')[:200]}")
    return "\n".join(lines), "\n".join(full)


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.exit(drive(args) if args.driver else run_world(args))


if __name__ == "__main__":
    main()
