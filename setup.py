"""Package discovery for setuptools (the rest of the configuration is in pyproject.toml).

Three folders of this repository install as one package: nvfp4_dist/ as nvfp4_dist, parallel/ as
nvfp4_dist.parallel and launch/ as nvfp4_dist.launch; csrc/ (the kernel sources, no Python) installs as
nvfp4_dist/csrc, from which the extension builds. Every folder below them that holds an __init__.py is
a subpackage, found here so that a new one needs no edit.
"""
import pathlib

from setuptools import setup

ROOT = pathlib.Path(__file__).resolve().parent
PACKAGE_FOLDERS = {"nvfp4_dist": "nvfp4_dist", "nvfp4_dist.parallel": "parallel", "nvfp4_dist.launch": "launch"}
KERNEL_SOURCES = ("nvfp4_dist.csrc", "csrc")


def subpackages(package: str, folder: pathlib.Path) -> list[str]:
    """`package` and, below `folder`, every folder with an __init__.py reached through folders that have one."""
    found = [package]
    for child in sorted(folder.iterdir()):
        if child.is_dir() and (child / "__init__.py").is_file():
            found += subpackages(f"{package}.{child.name}", child)
    return found


def discover_packages() -> list[str]:
    packages = [KERNEL_SOURCES[0]]
    for package, folder in PACKAGE_FOLDERS.items():
        packages += subpackages(package, ROOT / folder)
    return sorted(packages)


setup(packages=discover_packages(), package_dir={**PACKAGE_FOLDERS, KERNEL_SOURCES[0]: KERNEL_SOURCES[1]})
