"""The scripts under benchmarks/ loaded as modules: they are not a package, and import their siblings (provenance,
torchrun_setup) as scripts do, with benchmarks/ on sys.path."""
import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark_module(name: str):
    """benchmarks/<name>.py, executed once per call, registered in sys.modules (dataclasses look their module up
    there) as benchmarks_<name>."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
