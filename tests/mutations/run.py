"""Run the mutation catalog: a scratch copy of the repository, each mutation applied alone, its tests run against it.

A mutation is killed when its tests fail (the first failing test is reported), survives when they pass, and is
stale when its source text is not found exactly once. Before the mutations, the same tests run on the unmutated
copy and must pass (--no-baseline skips that, for a tree whose suite just passed).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from tests.mutations.catalog import MUTATIONS, Mutation

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("nvfp4_dist", "parallel", "launch", "csrc")   # where mutations may apply
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h")
DEFAULT_TIMEOUT_S = 900


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    status: str          # killed | survived | stale | error
    detail: str          # the killing test, or why stale/error
    seconds: float


SKIPPED_DIRS = {".git", "__pycache__", "build", "dist", ".pytest_cache", ".whl"}


def repository_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The files of the working tree that git tracks or would track (ignored build outputs left out); without git,
    every file outside the usual build and cache folders."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [path.relative_to(root) for path in root.rglob("*")
                if path.is_file() and not SKIPPED_DIRS.intersection(path.relative_to(root).parts)]
    return [pathlib.Path(name) for name in listed.decode().split("\0") if name and (root / name).is_file()]


def package_dirs(root: pathlib.Path) -> dict:
    """The packages that install from another folder ({"nvfp4_dist.parallel": "parallel", ...}): pyproject's
    setuptools package-dir, or the literal package-name -> folder tables of setup.py."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = None
    text = (root / "pyproject.toml").read_text()
    if tomllib is not None:
        table = tomllib.loads(text).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    else:
        match = re.search(r"^package-dir\s*=\s*\{([^}]*)\}", text, re.MULTILINE)
        table = dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', match.group(1))) if match else {}
    setup = root / "setup.py"
    if setup.exists():
        for node in ast.walk(ast.parse(setup.read_text())):
            if not isinstance(node, ast.Assign):
                continue
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            pairs = value.items() if isinstance(value, dict) else [value] if isinstance(value, tuple) else []
            table.update({package: folder for package, folder in (p for p in pairs if len(p) == 2)
                          if isinstance(package, str) and isinstance(folder, str) and package.startswith("nvfp4_dist")})
    return table


def make_scratch(directory: pathlib.Path) -> pathlib.Path:
    """Copy the repository into directory/repo and lay its packages out as installed (a subpackage whose source
    lives elsewhere, like nvfp4_dist.parallel in parallel/, is linked into place), so that PYTHONPATH=repo imports
    the copy, ahead of any editable install of the working tree."""
    scratch = directory / "repo"
    for relative in repository_files(REPO):
        target = scratch / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, target)
    for package, source in package_dirs(REPO).items():
        link = scratch.joinpath(*package.split("."))
        if not link.exists():
            link.symlink_to(scratch / source, target_is_directory=True)
    return scratch


def environment(scratch: pathlib.Path) -> dict:
    """This interpreter first on PATH (tests start python3 subprocesses), the scratch copy first on PYTHONPATH."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(scratch), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def check_imports_from(scratch: pathlib.Path) -> None:
    """Fail early if the scratch copy is not what `import nvfp4_dist...` finds."""
    code = ("import nvfp4_dist, nvfp4_dist.parallel, nvfp4_dist.launch\n"
            "print('\\n'.join(m.__path__[0] for m in (nvfp4_dist, nvfp4_dist.parallel, nvfp4_dist.launch)))")
    paths = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=environment(scratch), capture_output=True,
                           text=True, check=True).stdout.split()
    outside = [p for p in paths if not pathlib.Path(p).is_relative_to(scratch)]
    if outside:
        raise SystemExit(f"the scratch copy does not shadow the installed package: {outside}")


def source_files(scratch: pathlib.Path) -> list[pathlib.Path]:
    """The package's source files in the scratch copy, each once (not again through a package-dir link)."""
    found = {p.resolve(): p.resolve() for d in SOURCE_DIRS if (scratch / d).is_dir() for p in (scratch / d).rglob("*")
             if p.suffix in SOURCE_SUFFIXES and p.is_file()}
    return sorted(found.values())


def locate(old: str, files: list[pathlib.Path]) -> tuple:
    """(file, None) where `old` occurs exactly once in exactly one file, else (None, why)."""
    hits = [(path, path.read_text().count(old)) for path in files]
    hits = [(path, count) for path, count in hits if count]
    if not hits:
        return None, f"text not found: {old[:80]!r}"
    if len(hits) > 1 or hits[0][1] > 1:
        return None, f"text not unique ({sum(c for _, c in hits)} occurrences): {old[:80]!r}"
    return hits[0][0], None


def run_tests(scratch: pathlib.Path, tests, timeout_s: float, every_failure: bool = False) -> tuple:
    """(passed, the failing tests (the first one only, unless every_failure) or the summary line, seconds) of
    pytest over `tests` in the scratch copy."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *([] if every_failure else ["-x"]),
               *tests]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=scratch, env=environment(scratch), capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f} s", time.monotonic() - started
    seconds = time.monotonic() - started
    lines = result.stdout.splitlines()
    failures = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if result.returncode == 0:
        return True, lines[-1] if lines else "", seconds
    if failures:
        names = [f.split(" ", 1)[1] for f in failures]
        return False, summarise(names) if every_failure else names[0], seconds
    return False, f"pytest exit {result.returncode}: " + (lines[-1] if lines else result.stderr[-300:]), seconds


def summarise(node_ids: list[str]) -> str:
    """'N failed: test_a (3 cases), test_b, ...': the failing tests by function, parametrized cases counted."""
    counts: dict = {}
    for node in node_ids:
        function = node.split("[")[0]
        counts[function] = counts.get(function, 0) + 1
    return f"{len(node_ids)} failed: " + ", ".join(f"{f}" + (f" ({n} cases)" if n > 1 else "") for f, n in counts.items())


def apply(mutation: Mutation, scratch: pathlib.Path) -> tuple:
    """Apply the mutation's edits; returns (originals {path: text} to restore, None) or ({}, why it is stale)."""
    files = source_files(scratch)
    originals = {}
    for old, new in mutation.edits:
        path, why = locate(old, files)
        if path is None:
            for restored, text in originals.items():
                restored.write_text(text)
            return {}, why
        originals.setdefault(path, path.read_text())
        path.write_text(path.read_text().replace(old, new))
    return originals, None


def run_mutation(mutation: Mutation, scratch: pathlib.Path, timeout_s: float, every_failure: bool) -> Outcome:
    started = time.monotonic()
    originals, stale = apply(mutation, scratch)
    if stale:
        return Outcome(mutation, "stale", stale, 0.0)
    try:
        passed, detail, _ = run_tests(scratch, mutation.tests, timeout_s, every_failure)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    return Outcome(mutation, "survived" if passed else "killed", "" if passed else detail,
                   time.monotonic() - started)


def table(outcomes: list[Outcome]) -> str:
    width = max(len(o.mutation.name) for o in outcomes)
    lines = [f"{'mutation':<{width}}  {'area':<10}  {'status':<8}  {'seconds':>7}  killed by / detail",
             "-" * (width + 60)]
    for o in outcomes:
        lines.append(f"{o.mutation.name:<{width}}  {o.mutation.area:<10}  {o.status:<8}  {o.seconds:7.1f}  {o.detail}")
    counts = {status: sum(o.status == status for o in outcomes) for status in ("killed", "survived", "stale")}
    lines.append(f"\n{len(outcomes)} mutations: {counts['killed']} killed, {counts['survived']} survived, "
                 f"{counts['stale']} stale")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__)
    parser.add_argument("--only", help="run the mutations whose name matches this regex")
    parser.add_argument("--list", action="store_true", help="print the catalog and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every mutation's text occurs exactly once in the package (no tests)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running the selected mutations' tests on the unmutated copy first")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutation's tests")
    parser.add_argument("--every-failure", action="store_true",
                        help="run each mutation's tests to the end and list every test that fails (slower)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mutations = [m for m in MUTATIONS if not args.only or re.search(args.only, m.name)]
    if args.list:
        for m in mutations:
            print(f"{m.name:<40} {m.area:<10} {m.description}\n{'':<40} tests: {' '.join(m.tests)}")
        return 0
    if not mutations:
        print(f"no mutation matches --only {args.only!r}")
        return 2
    if args.check:
        files = source_files(REPO)
        stale = [(m.name, why) for m in mutations for old, _ in m.edits for why in [locate(old, files)[1]] if why]
        for name, why in stale:
            print(f"stale: {name}: {why}")
        print(f"{len(mutations)} mutations, {len(stale)} stale edits")
        return 1 if stale else 0
    directory = pathlib.Path(tempfile.mkdtemp(prefix="nvfp4_mutations_"))
    try:
        scratch = make_scratch(directory)
        check_imports_from(scratch)
        print(f"scratch copy: {scratch}", flush=True)
        if not args.no_baseline:
            baseline = sorted({test for m in mutations for test in m.tests})
            passed, detail, seconds = run_tests(scratch, baseline, args.timeout * 2)
            print(f"baseline ({len(baseline)} test selections, unmutated): "
                  f"{'passed' if passed else 'FAILED'} in {seconds:.0f} s: {detail}", flush=True)
            if not passed:
                return 2
        outcomes = []
        for index, mutation in enumerate(mutations, 1):
            outcome = run_mutation(mutation, scratch, args.timeout, args.every_failure)
            outcomes.append(outcome)
            print(f"[{index}/{len(mutations)}] {mutation.name}: {outcome.status} ({outcome.seconds:.0f} s) "
                  f"{outcome.detail}", flush=True)
        print()
        print(table(outcomes))
        return 0 if all(o.status == "killed" for o in outcomes) else 1
    finally:
        if args.keep:
            print(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
