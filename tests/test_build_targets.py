"""The extension's build settings, without a GPU: the targets chosen from (mocked) device capabilities, the
error naming a device the toolkit cannot build for, the C++ standard read from torch's headers, and where
the kernel sources are found (installed package or checkout)."""
import logging
import pathlib
import shutil
import stat
import sys

import pytest
import torch

from nvfp4_dist import _extension

CUDA_13_0 = _extension.CudaToolkit("/cuda-13.0/bin/nvcc", "13.0", frozenset(
    ["sm_75", "sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121"]))
CUDA_12_8 = _extension.CudaToolkit("/cuda-12.8/bin/nvcc", "12.8", frozenset(
    ["sm_50", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_101", "sm_120"]))
CUDA_12_4 = _extension.CudaToolkit("/cuda-12.4/bin/nvcc", "12.4", frozenset(["sm_80", "sm_86", "sm_89", "sm_90"]))
PTX = "-gencode=arch=compute_90,code=compute_90"


def sass(target: str) -> str:
    return f"-gencode=arch={target.replace('sm_', 'compute_')},code={target}"


@pytest.fixture
def devices(monkeypatch):
    """Call with [(name, (major, minor)), ...] to make those the visible CUDA devices."""
    def make_visible(listed):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(listed))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(listed))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: listed[i][0])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: listed[i][1])
    return make_visible


@pytest.mark.parametrize("name, capability, target", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "sm_90a"),
    ("NVIDIA B200", (10, 0), "sm_100a"),
    ("NVIDIA B300 SXM6 AC", (10, 3), "sm_103a"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), "sm_120a"),
])
def test_each_known_capability_gets_its_sass_and_the_ptx_fallback(devices, name, capability, target):
    devices([(name, capability)])
    assert _extension.arch_flags(CUDA_13_0) == [sass(target), PTX]


@pytest.mark.parametrize("capability", [(12, 1), (11, 0), (13, 0)])
def test_a_capability_without_sass_target_runs_the_ptx(devices, caplog, capability):
    devices([("NVIDIA Future GPU", capability)])
    with caplog.at_level(logging.INFO, logger="nvfp4_dist"):
        assert _extension.arch_flags(CUDA_13_0) == [PTX]
    assert f"NVIDIA Future GPU, compute capability {capability[0]}.{capability[1]}" in caplog.text
    assert "compute_90 PTX" in caplog.text


def test_mixed_devices_get_each_target_once_in_capability_order(devices):
    devices([("NVIDIA RTX 5090", (12, 0)), ("NVIDIA H100", (9, 0)), ("NVIDIA H100", (9, 0)), ("Next", (13, 0))])
    assert _extension.arch_flags(CUDA_13_0) == [sass("sm_90a"), sass("sm_120a"), PTX]


def test_without_a_visible_gpu_every_buildable_target_is_built(devices):
    devices([])
    assert _extension.arch_flags(CUDA_13_0) == [sass(t) for t in ("sm_90a", "sm_100a", "sm_103a", "sm_120a")] + [PTX]
    assert _extension.arch_flags(CUDA_12_8) == [sass(t) for t in ("sm_90a", "sm_100a", "sm_120a")] + [PTX]
    assert _extension.arch_flags(CUDA_12_4) == [sass("sm_90a"), PTX]


@pytest.mark.parametrize("toolkit, name, capability, target, first_release", [
    (CUDA_12_8, "NVIDIA B300 SXM6 AC", (10, 3), "sm_103a", "12.9"),
    (CUDA_12_4, "NVIDIA B200", (10, 0), "sm_100a", "12.8"),
    (CUDA_12_4, "NVIDIA GeForce RTX 5090", (12, 0), "sm_120a", "12.8"),
])
def test_a_target_the_toolkit_cannot_build_names_device_capability_and_toolkit(devices, toolkit, name, capability,
                                                                              target, first_release):
    devices([("NVIDIA H100", (9, 0)), (name, capability)])
    with pytest.raises(RuntimeError) as error:
        _extension.arch_flags(toolkit)
    message = str(error.value)
    assert f"GPU 1 ({name}, compute capability {capability[0]}.{capability[1]}) needs {target}" in message
    assert f"nvcc {toolkit.version} ({toolkit.nvcc}) cannot build" in message
    assert f"CUDA {first_release} or newer" in message


def test_a_gpu_older_than_hopper_is_refused_by_name(devices):
    devices([("NVIDIA A100-SXM4-80GB", (8, 0))])
    with pytest.raises(RuntimeError, match=r"GPU 0 \(NVIDIA A100-SXM4-80GB, compute capability 8\.0\).*9\.0 or newer"):
        _extension.arch_flags(CUDA_13_0)


def test_toolkit_release_and_targets_come_from_nvcc(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\ncase "$1" in\n'
                    '  --version) echo "Cuda compilation tools, release 12.8, V12.8.93";;\n'
                    '  --list-gpu-code) printf "sm_90\\nsm_100\\nsm_120\\n";;\n'
                    'esac\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    toolkit = _extension.cuda_toolkit(str(fake))
    assert (toolkit.version, toolkit.gpu_codes) == ("12.8", frozenset({"sm_90", "sm_100", "sm_120"}))
    assert [t for t in ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "compute_90") if toolkit.builds(t)] == [
        "sm_90a", "sm_100a", "sm_120a", "compute_90"]
    with pytest.raises(RuntimeError, match="nvcc could not run"):
        _extension.cuda_toolkit(str(tmp_path / "missing-nvcc"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) on the PATH")
def test_the_local_nvcc_is_read():
    toolkit = _extension.cuda_toolkit(shutil.which("nvcc"))
    assert toolkit.version.count(".") == 1 and toolkit.builds("sm_90a") and toolkit.builds("compute_90")


def write_header(include: pathlib.Path, text: str) -> pathlib.Path:
    (include / "ATen").mkdir(parents=True)
    (include / "ATen" / "ATen.h").write_text(text)
    return include


@pytest.mark.parametrize("required, standard", [("201703L", "c++17"), ("202002L", "c++20"), (None, "c++17")])
def test_cxx_standard_is_what_torchs_headers_require(tmp_path, required, standard):
    guard = (f"#if !defined(_MSC_VER) && __cplusplus < {required}\n#error C++ required to use ATen.\n#endif\n"
             if required else "#pragma once\n")
    include = write_header(tmp_path / "include", guard + "#include <ATen/Context.h>\n")
    assert _extension.cxx_standard(include) == standard
    host, device = _extension.compile_flags(include)
    assert f"-std={standard}" in host and f"-std={standard}" in device and "-fmad=false" in device


def test_cxx_standard_of_the_installed_torch():
    aten = (pathlib.Path(torch.__file__).parent / "include" / "ATen" / "ATen.h").read_text()
    assert _extension.cxx_standard() == ("c++20" if "__cplusplus < 202002L" in aten else "c++17")


def test_load_builds_for_the_chosen_targets_in_a_folder_keyed_by_them(devices, monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension
    devices([("NVIDIA B300 SXM6 AC", (10, 3))])
    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs)
        return object()
    monkeypatch.setattr(_extension, "_module", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_extension, "cuda_toolkit", lambda nvcc=None: CUDA_13_0)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.delenv("NVFP4_BUILD_DIR", raising=False)
    monkeypatch.setattr(pathlib.Path, "home", lambda: tmp_path)
    monkeypatch.setitem(sys.modules, "nvfp4_dist._C", None)  # restored after the test
    _extension.load_extension()
    (kwargs,) = calls
    standard = f"-std={_extension.cxx_standard()}"
    assert kwargs["extra_cuda_cflags"][-2:] == [sass("sm_103a"), PTX]
    assert standard in kwargs["extra_cuda_cflags"] and standard in kwargs["extra_cflags"]
    assert kwargs["build_directory"].endswith("_sm_103a-compute_90")
    assert pathlib.Path(kwargs["build_directory"]).parent == tmp_path / ".cache" / "nvfp4_dist"
    assert pathlib.Path(kwargs["sources"][-1]).name == "bindings.cpp"

    monkeypatch.setattr(_extension, "_module", None)
    monkeypatch.setattr(_extension, "cuda_toolkit", lambda nvcc=None: CUDA_12_8)
    with pytest.raises(RuntimeError, match=r"needs sm_103a, which nvcc 12\.8"):
        _extension.load_extension()
    assert len(calls) == 1  # refused before any compilation


@pytest.mark.parametrize("layout", ["installed", "checkout"])
def test_kernel_sources_are_found_in_an_installed_package_and_in_a_checkout(monkeypatch, tmp_path, layout):
    package = tmp_path / "nvfp4_dist"
    csrc = package / "csrc" if layout == "installed" else tmp_path / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "bindings.cpp").write_text("")
    (csrc / "quantize.cu").write_text("")
    monkeypatch.setattr(_extension, "__file__", str(package / "_extension.py"))
    assert _extension.csrc_directory() == csrc
    assert [pathlib.Path(s).name for s in _extension.source_files()] == ["quantize.cu", "bindings.cpp"]


def test_missing_kernel_sources_say_where_they_were_looked_for(monkeypatch, tmp_path):
    monkeypatch.setattr(_extension, "__file__", str(tmp_path / "nvfp4_dist" / "_extension.py"))
    with pytest.raises(RuntimeError, match=r"kernel sources are missing.*nvfp4_dist/csrc"):
        _extension.csrc_directory()
