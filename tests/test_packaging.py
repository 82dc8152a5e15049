"""The packaging settings: setup.py finds every subpackage and maps the source folders into nvfp4_dist, the
declared torch range holds the torch that runs the tests, and every source parses as Python 3.10 (the oldest
declared; CI runs a newer one). The built wheel and sdist themselves are checked by .ci/check_dist.py."""
import ast
import pathlib
import runpy
import sys

import pytest
import setuptools
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from setuptools.config.pyprojecttoml import load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = load_file(ROOT / "pyproject.toml")  # setuptools' reader: tomllib is Python 3.11+


@pytest.fixture(scope="module")
def setup_arguments():
    """What setup.py passes to setuptools.setup()."""
    captured = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    finally:
        patch.undo()
    return captured


def test_every_folder_of_python_sources_is_a_package(setup_arguments):
    folders = {"nvfp4_dist": "nvfp4_dist", "parallel": "nvfp4_dist.parallel", "launch": "nvfp4_dist.launch"}
    want = {"nvfp4_dist.csrc"}
    for folder, package in folders.items():
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.parent.relative_to(ROOT / folder)
            want.add(".".join((package, *relative.parts)))
    assert set(setup_arguments["packages"]) == want
    for required in ("nvfp4_dist.reference", "nvfp4_dist.gemm", "nvfp4_dist.parallel.megatron"):
        assert required in want


def test_package_folders_map_into_nvfp4_dist(setup_arguments):
    assert setup_arguments["package_dir"] == {"nvfp4_dist": "nvfp4_dist", "nvfp4_dist.parallel": "parallel",
                                              "nvfp4_dist.launch": "launch", "nvfp4_dist.csrc": "csrc"}
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    shipped = {path.name for pattern in data["nvfp4_dist.csrc"] for path in (ROOT / "csrc").glob(pattern)}
    assert shipped == {path.name for path in (ROOT / "csrc").iterdir() if path.is_file()}
    launch = set(data["nvfp4_dist.launch"])
    assert {"*.sh", "*.sbatch"} <= launch and any(pattern.startswith("data/") for pattern in launch)


def test_declared_ranges_hold_this_torch_and_python():
    torch_range = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert Version(torch.__version__.split("+")[0]) in SpecifierSet(torch_range.removeprefix("torch"))
    assert Version("2.14.1") in SpecifierSet(torch_range.removeprefix("torch"))
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert Version(python) in SpecifierSet(PYPROJECT["project"]["requires-python"])


def python_sources():
    for folder in ("nvfp4_dist", "parallel", "launch", "tests", "tests_multigpu", "benchmarks", ".ci"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield ROOT / "setup.py"


def test_sources_parse_as_the_oldest_declared_python():
    oldest = tuple(int(n) for n in PYPROJECT["project"]["requires-python"].split(",")[0].lstrip(">=").split("."))
    assert oldest == (3, 10)
    for source in python_sources():
        ast.parse(source.read_text(), filename=str(source), feature_version=oldest)
