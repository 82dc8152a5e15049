"""nvfp4_dist.environment: every NVFP4_* variable reads its default when unset or empty and refuses bad values."""
import re

import pytest

from nvfp4_dist import environment

BAD_VALUES = {"0 or 1": "yes", "an integer >= 0": "-1"}


@pytest.mark.parametrize("variable", environment.VARIABLES, ids=lambda v: v.name)
def test_unset_and_empty_give_the_default(monkeypatch, variable):
    monkeypatch.delenv(variable.name, raising=False)
    assert variable.read() == variable.default
    monkeypatch.setenv(variable.name, "")
    assert variable.read() == variable.default


@pytest.mark.parametrize("variable", [v for v in environment.VARIABLES if v is not environment.BUILD_DIR],
                         ids=lambda v: v.name)
def test_bad_value_names_variable_value_and_allowed(monkeypatch, variable):
    monkeypatch.setenv(variable.name, BAD_VALUES.get(variable.allowed, "bogus"))
    with pytest.raises(ValueError, match=f"{variable.name}=.*allowed values are {re.escape(variable.allowed)}"):
        variable.read()


def test_values_parse(monkeypatch):
    monkeypatch.setenv("NVFP4_FORCE_REFERENCE", "1")
    assert environment.FORCE_REFERENCE.read() is True
    monkeypatch.setenv("NVFP4_BF16_LAST_LAYERS", "3")
    assert environment.BF16_LAST_LAYERS.read() == 3
    monkeypatch.setenv("NVFP4_SYMMETRIC_MEMORY", " OFF ")
    assert environment.SYMMETRIC_MEMORY.read() is False
    monkeypatch.setenv("NVFP4_SYMMETRIC_MEMORY", "on")
    assert environment.SYMMETRIC_MEMORY.read() is True
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fused")
    assert environment.HOPPER_GEMM.read() == "fused"
    monkeypatch.setenv("NVFP4_BUILD_DIR", "/tmp/nvfp4-build")
    assert environment.BUILD_DIR.read() == "/tmp/nvfp4-build"


def test_every_variable_is_listed_once():
    names = [variable.name for variable in environment.VARIABLES]
    assert len(names) == len(set(names)) and all(name.startswith("NVFP4_") for name in names)


def test_reads_follow_every_change_and_never_keep_a_refusal(monkeypatch):
    """Variable.read keeps parsed values per text (environment.raw_values): a change, a change back, unsetting and
    a bad value each take effect at the next read; a refused value is refused again."""
    variable = environment.HOPPER_GEMM
    for text, expected in (("fused", "fused"), ("dequantize", "dequantize"), ("fused", "fused"), ("", "dequantize")):
        monkeypatch.setenv(variable.name, text)
        assert variable.read() == expected
    monkeypatch.delenv(variable.name)
    assert variable.read() == variable.default
    for _ in range(2):
        monkeypatch.setenv(variable.name, "bogus")
        with pytest.raises(ValueError, match="NVFP4_HOPPER_GEMM='bogus'"):
            variable.read()
    monkeypatch.setenv(variable.name, "fused")
    assert variable.read() == "fused"


def test_raw_values_are_a_key_of_the_settings(monkeypatch):
    names = ("NVFP4_DISABLE_SR", "NVFP4_OVERLAP")
    monkeypatch.setenv("NVFP4_DISABLE_SR", "1")
    monkeypatch.delenv("NVFP4_OVERLAP", raising=False)
    first = environment.raw_values(names)
    assert first == environment.raw_values(names) and first[1] is None
    monkeypatch.setenv("NVFP4_OVERLAP", "1")
    assert environment.raw_values(names) != first
    monkeypatch.delenv("NVFP4_OVERLAP")
    assert environment.raw_values(names) == first


def test_reads_follow_a_replaced_os_environ(monkeypatch):
    """A program that assigns os.environ another mapping is read through that mapping."""
    import os
    monkeypatch.setattr(os, "environ", {"NVFP4_BF16_FIRST_LAYERS": "2"})
    assert environment.BF16_FIRST_LAYERS.read() == 2
    assert environment.raw_values(("NVFP4_BF16_FIRST_LAYERS", "NVFP4_OVERLAP")) == ("2", None)
