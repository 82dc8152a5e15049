"""Check that a built wheel and sdist hold the whole package, compared with the files git tracks:

- the wheel: every tracked file of nvfp4_dist/, parallel/, launch/ and csrc/ at its installed path
  (nvfp4_dist/..., nvfp4_dist/parallel/..., nvfp4_dist/launch/..., nvfp4_dist/csrc/...) and nothing else
  besides its metadata: every subpackage, the kernel sources, the launch data and scripts;
- the sdist: those folders, tests/, docs/ and the build files;
- optionally a second wheel (built from the sdist): the same files as the first.

Usage: python .ci/check_dist.py WHEEL SDIST [WHEEL_FROM_SDIST]
"""
import pathlib
import subprocess
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# repository folder -> where its files lie in the installed package
INSTALLED_AT = {"nvfp4_dist": "nvfp4_dist", "parallel": "nvfp4_dist/parallel", "launch": "nvfp4_dist/launch",
                "csrc": "nvfp4_dist/csrc"}
SDIST_ALSO = ("tests", "docs", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


def tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return listed.stdout.split()


def wheel_files(wheel: str) -> set[str]:
    return {name for name in zipfile.ZipFile(wheel).namelist()
            if not name.endswith("/") and ".dist-info/" not in name}


def compare(what: str, want: set[str], have: set[str], exact: bool) -> bool:
    missing, extra = sorted(want - have), sorted(have - want) if exact else []
    for name in missing:
        print(f"{what}: missing {name}")
    for name in extra:
        print(f"{what}: unexpected {name}")
    if not missing and not extra:
        print(f"ok    {what}: {len(want)} files as expected")
    return not missing and not extra


def main(wheel: str, sdist: str, second_wheel: str | None = None) -> int:
    installed = set()
    for folder, target in INSTALLED_AT.items():
        installed |= {target + name[len(folder):] for name in tracked(folder)}
    packages = sorted({name.rpartition("/")[0] for name in installed if name.endswith("/__init__.py")})
    print(f"packages: {', '.join(p.replace('/', '.') for p in packages)}")
    ok = compare(f"wheel {pathlib.Path(wheel).name}", installed, wheel_files(wheel), exact=True)

    with tarfile.open(sdist) as archive:  # names below the top folder nvfp4_dist-<version>/
        names = {member.name.partition("/")[2] for member in archive.getmembers() if member.isfile()}
    ok &= compare(f"sdist {pathlib.Path(sdist).name}", set(tracked(*INSTALLED_AT, *SDIST_ALSO)), names, exact=False)

    if second_wheel:
        ok &= compare("wheel built from the sdist", wheel_files(wheel), wheel_files(second_wheel), exact=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
